"""Ends the sessions of the token log that nothing was appended to for ``--session-idle``
(TokenLog.expire_idle): an engine cannot tell when a conversation is over, and a session
never ended would hold its tenant's token-log quota for ever. Checked every quarter of the
idle time, but no less often than every minute nor more often than every MIN_PERIOD_S, so a session goes at most
that long after it idled out.
A session a live migration has not decided (being fenced here, or copied here) is kept: its
writes are refused meanwhile (DESIGN §12.8); so is one fenced here until its target adopted it
(``refresh`` asks etcd before each sweep)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from kvstore.server.metrics import Metrics
from kvstore.server.tokenlog import TokenLog

logger = logging.getLogger(__name__)

MAX_PERIOD_S = 60.0
MIN_PERIOD_S = 0.05  # however small the idle time: each round reads every session's record


class SessionExpiry:
    def __init__(self, wal: TokenLog, idle_s: float, metrics: Metrics, keep: Callable[[bytes], bool] = lambda sid: False,
                 refresh: Callable[[], object] | None = None) -> None:
        self.wal = wal
        self.keep = keep  # sessions kept however long they idle: those a migration still needs (SessionOwners.kept)
        self.refresh = refresh  # before each sweep, outside the log's lock: what ``keep`` reads is brought up to date
        self.idle_s = idle_s
        self.metrics = metrics
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="session-expiry", daemon=True)

    def start(self) -> None:
        if self.idle_s > 0:  # 0: sessions end by EndSession only
            self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join(5)

    def sweep(self) -> int:
        if self.refresh is not None:
            self.refresh()
        ended = self.wal.expire_idle(self.idle_s, self.keep)
        if ended:
            self.metrics.sessions_expired.inc(ended)
            logger.info("%d session(s) idle for %.0f s ended", ended, self.idle_s)
        return ended

    def _run(self) -> None:
        period = max(MIN_PERIOD_S, min(MAX_PERIOD_S, self.idle_s / 4))
        while not self._stopped.wait(period):
            try:
                self.sweep()
            except Exception:  # the sweeper outlives one bad round (a full map: the next one may fit)
                logger.exception("session expiry failed")

"""Each tenant's secret salt: 16 random bytes the server assigns once and keeps.

The salt is folded into the tenant's namespace ids (see DESIGN §11), so another tenant can
neither compute them nor probe their prefixes. It is random, not derived from the tenant's
name or anything another tenant knows, and kept in ``DATA_DIR/tenant-salts.json`` (0600 in
a 0700 directory): losing the file makes every tenant's cached pages unreachable (new
namespace ids), so a damaged one stops the server instead of being silently replaced.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import threading
from collections.abc import Iterable
from pathlib import Path

from kvstore.errors import ConfigError

logger = logging.getLogger(__name__)

SALT_BYTES = 16
FILE_NAME = "tenant-salts.json"
_DIR_MODE = 0o700
_FILE_MODE = 0o600


class TenantSalts:
    """The salts of all tenants, loaded at start and grown as tenants appear.

    Thread-safety: ``salt`` reads without a lock (a dict read); creating a salt takes the
    lock, writes the whole file (temporary file, fsync, rename, fsync of the directory) and
    only then publishes the salt in memory, so a salt is never handed out that a crash
    could forget.
    """

    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir / FILE_NAME
        self._lock = threading.Lock()
        self._salts: dict[str, bytes] = self._read()

    def _read(self) -> dict[str, bytes]:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return {}
        except OSError as exc:
            raise ConfigError(f"{self.path}: cannot read the tenant salts: {exc.strerror or exc}") from None
        try:
            doc = json.loads(raw)
            salts = {str(t): bytes.fromhex(h) for t, h in doc["salts"].items()}
            if any(len(s) != SALT_BYTES for s in salts.values()):
                raise ValueError(f"a salt is not {SALT_BYTES} bytes")
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(f"{self.path} is damaged ({exc}). Restore it from a backup; deleting it assigns new "
                              "salts, which makes every tenant's cached pages unreachable") from None
        os.chmod(self.path, _FILE_MODE)  # private also when an older copy was not
        return salts

    def salt(self, tenant: str) -> bytes:
        """The salt of ``tenant``, created (and persisted) the first time it is asked for."""
        found = self._salts.get(tenant)
        if found is not None:
            return found
        self.ensure((tenant,))
        return self._salts[tenant]

    def ensure(self, tenants: Iterable[str]) -> None:
        """Creates the salts of the tenants that have none yet, in one write."""
        with self._lock:
            missing = sorted(set(tenants) - set(self._salts))
            if not missing:
                return
            grown = {**self._salts, **{t: secrets.token_bytes(SALT_BYTES) for t in missing}}
            self._write(grown)
            self._salts = grown
        logger.info("assigned a salt to tenant(s) %s", ", ".join(missing))

    def close(self) -> None:
        """Nothing to release here (the file is written whole each time); the cluster's store closes its etcd channel."""

    def _write(self, salts: dict[str, bytes]) -> None:
        directory = self.path.parent
        directory.mkdir(mode=_DIR_MODE, parents=True, exist_ok=True)
        tmp = directory / f".{FILE_NAME}.{os.getpid()}.tmp"
        body = json.dumps({"version": 1, "salts": {t: s.hex() for t, s in sorted(salts.items())}}, indent=1).encode()
        try:
            with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, _FILE_MODE), "wb") as f:
                os.fchmod(f.fileno(), _FILE_MODE)  # O_CREAT's mode does not apply to a leftover temporary file
                f.write(body)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

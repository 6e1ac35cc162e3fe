"""A generation session's token log, and recovery after a crash.

    session = client.session("req-42", sync_every=8)
    await session.start(prompt_ids)          # logged durably
    await session.returned([token])          # per generated token; durable every 8 tokens
    ... emit only session.durable_tokens to the user ...
    rec = await client.recover("req-42")     # after a crash of the worker or the server
    # rec.tokens: prompt + everything already returned; rec.stored_tokens: KV prefix in the
    # store; rec.to_prefill: what must be computed again before generating the next token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvstore.errors import InvalidRequest

if TYPE_CHECKING:
    from kvstore.client.client import KVStoreClient


@dataclass(frozen=True)
class LoggedSession:
    """What the server's log holds for a session: the prompt, then the tokens returned."""

    prompt_tokens: int
    tokens: list[int]


@dataclass(frozen=True)
class Recovery:
    session_id: str
    prompt_tokens: int
    tokens: list[int]          # the prompt, then every token already returned to the user
    stored_tokens: int         # leading tokens whose KV is in the store (page-aligned)
    to_prefill: list[int]      # tokens to prefill again; the last logged token is fed next

    @property
    def returned(self) -> list[int]:
        return self.tokens[self.prompt_tokens :]


CHECKPOINT_POLICIES = ("ram", "write-through", "periodic")


class SessionLog:
    """Appends a session's tokens to the server's write-ahead log, batching syncs, and
    checkpoints its KV by policy:

    * ``ram``: pages stay in the host tier (fast, lost with the server);
    * ``write-through``: every completed page is written to SSD as it completes;
    * ``periodic``: completed pages go to SSD every ``checkpoint_tokens`` tokens.
    """

    def __init__(self, client: KVStoreClient, session_id: str, sync_every: int = 1, sync_ms: float = 50.0,
                 checkpoint: str = "periodic", checkpoint_tokens: int = 256) -> None:
        if sync_every < 1:
            raise InvalidRequest("sync_every must be >= 1")
        if checkpoint not in CHECKPOINT_POLICIES:
            raise InvalidRequest(f"checkpoint must be one of {CHECKPOINT_POLICIES}, got {checkpoint!r}")
        self.checkpoint_policy = checkpoint
        self.checkpoint_tokens = checkpoint_tokens
        self.checkpointed = 0      # tokens whose KV is durable in the store
        self.client = client
        self.session_id = session_id
        self.sync_every = sync_every
        self.sync_s = sync_ms / 1000
        self.logged = 0          # tokens the server has (maybe not yet synced)
        self.durable_tokens = 0  # tokens known durable: safe to show the user
        self._pending: list[int] = []
        self._last_sync = time.monotonic()

    async def _append(self, tokens: list[int], sync: bool, prompt_tokens: int = 0) -> None:
        self.logged = await self.client.append_tokens(self.session_id, tokens, expected_length=self.logged, sync=sync,
                                                      prompt_tokens=prompt_tokens)
        if sync:
            self.durable_tokens = self.logged
            self._last_sync = time.monotonic()

    async def start(self, prompt: Any) -> None:
        tokens = [int(t) for t in prompt]
        await self._append(tokens, sync=True, prompt_tokens=len(tokens))

    async def returned(self, tokens: Any) -> int:
        """Logs tokens given to the user; returns how many logged tokens are durable."""
        self._pending.extend(int(t) for t in tokens)
        if len(self._pending) >= self.sync_every or time.monotonic() - self._last_sync >= self.sync_s:
            await self.flush()
        return self.durable_tokens

    async def flush(self) -> int:
        """Appends the pending tokens durably. When the append fails (TierUnavailable: try again)
        they stay pending for the next flush: dropped, the log would hold a hole after them."""
        pending = list(self._pending)  # tokens returned meanwhile stay for the next flush
        await self._append(pending, sync=True)
        del self._pending[: len(pending)]
        return self.durable_tokens

    async def checkpoint(self, tokens: Any, kv: Any, force: bool = False) -> int:
        """Stores the KV of the completed pages of ``tokens`` as the policy says; returns
        the tokens whose KV is durable. Call it after each step (cheap when nothing is due)."""
        page = self.client.layout.page_tokens
        complete = len(tokens) // page * page
        due = {
            "ram": False,
            "write-through": complete > self.checkpointed,
            "periodic": complete - self.checkpointed >= self.checkpoint_tokens,
        }[self.checkpoint_policy]
        if force or due:
            self.checkpointed = await self.client.put(list(tokens)[:complete], kv, durable=self.checkpoint_policy != "ram",
                                                      session_id=self.session_id)
        elif self.checkpoint_policy == "ram" and complete > self.checkpointed:
            await self.client.put(list(tokens)[:complete], kv, session_id=self.session_id)
        return self.checkpointed if self.checkpoint_policy != "ram" else 0

    async def end(self) -> None:
        await self.client.end_session(self.session_id)


async def recover(client: KVStoreClient, session_id: str) -> Recovery | None:
    """See KVStoreClient.recover."""
    logged = await client.read_session(session_id)
    if logged is None:
        return None
    tokens = logged.tokens
    hit = await client.lookup(tokens[: max(0, len(tokens) - 1)])
    return Recovery(session_id, logged.prompt_tokens, tokens, hit.num_tokens,
                    tokens[hit.num_tokens : max(hit.num_tokens, len(tokens) - 1)])

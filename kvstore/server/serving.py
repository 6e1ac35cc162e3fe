"""Whether a cluster node may answer reads now (DESIGN §12.5), as one small object the server
makes before the placement core: the core and the session owners ask it before every read or
session write, and the cluster runtime, made after the core, drives it. Without it the core
would need the runtime, which needs the core."""

from __future__ import annotations

from collections.abc import Callable


class ServingState:
    """False until the runtime ``follow``s its catch-up with etcd's generations, then what that
    answers, until ``leave``. Thread-safe: each call reads two attributes, each set once."""

    def __init__(self) -> None:
        self._caught_up: Callable[[], bool] | None = None
        self.leaving = False  # the node is leaving the cluster: calls still arriving answer from it alone

    def follow(self, caught_up: Callable[[], bool]) -> None:
        """From now on: a member caught up with etcd's generations since it registered (the
        runtime's GenerationSync, made when it starts)."""
        self._caught_up = caught_up

    def leave(self) -> None:
        self.leaving = True

    def __call__(self) -> bool:
        caught_up = self._caught_up
        return not self.leaving and caught_up is not None and caught_up()

"""Errors of cluster mode.

They subclass the shared hierarchy in kvstore/errors.py so a servicer maps them like any
other (both are UNAVAILABLE-shaped: retry later, or serve what is local).
"""

from __future__ import annotations

from kvstore.errors import KVStoreError


class CoordinatorUnavailable(KVStoreError):
    """etcd did not answer within the call's deadline (down, partitioned, restarting).
    Nothing is known to have changed: the caller retries or keeps its last view."""


class WatchLost(CoordinatorUnavailable):
    """A watch stream ended, or etcd compacted past the revision it would resume from; the
    watcher takes a fresh snapshot before it trusts its view again."""


class NotAMember(KVStoreError):
    """This node's lease is gone (or may be): it must not act as a member (answer as a shard
    owner, publish records) until it has re-registered under a new epoch."""


class TransportError(KVStoreError):
    """A node-to-node transfer failed (peer gone, connection reset, deadline passed). Every
    destination buffer of the request is released back to the caller untouched by late bytes;
    pages already verified stay valid."""


class DestinationsInUse(TransportError):
    """A transfer was abandoned while the transport may still write into its destination buffers
    (UCX receives still posted after the abort): the caller must never hand them to another use
    (an arena slot kept back, not given to another page)."""

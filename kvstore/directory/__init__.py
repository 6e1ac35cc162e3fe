"""The directory: page key -> locations, and the event stream routers follow."""

from kvstore.directory.events import Event, EventKind, EventLog
from kvstore.directory.store import Directory, Entry

__all__ = ["Directory", "Entry", "Event", "EventKind", "EventLog"]

"""The placement core: which tier a page lives in, and moving it there without holding a
lock over disk I/O. ``Placement`` is the core (core.py); see the package README."""

from kvstore.server.placement.core import Placement
from kvstore.server.placement.demoter import Demoter
from kvstore.server.placement.reads import AcquiredPage
from kvstore.server.placement.view import CoreView

__all__ = ["AcquiredPage", "CoreView", "Demoter", "Placement"]

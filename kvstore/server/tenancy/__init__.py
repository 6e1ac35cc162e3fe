"""Tenants on one server: who owns each namespace, what a caller may do with it, and how
much each tenant may hold (see README.md)."""

from __future__ import annotations

from kvstore.server.tenancy.access import Tenancy
from kvstore.server.tenancy.owners import NamespaceOwners
from kvstore.server.tenancy.quotas import Quotas

__all__ = ["NamespaceOwners", "Quotas", "Tenancy"]

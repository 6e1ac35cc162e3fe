"""What only the nodes of a cluster may ask (DESIGN §11-12), and the tenant such a call acts for.

More: kvstore/server/tenancy/README.md (### node_calls.py).
"""

from __future__ import annotations

from kvstore.errors import ConfigError, InvalidRequest, PermissionDenied
from kvstore.security.identity import Identity, Rights, check_tenant_name

NODE_TENANT_RIGHTS = Rights.READ | Rights.WRITE
MAX_NODE_ID = 128  # characters of the node id a GrantTransfer names
MAX_REPLICAS = 16  # Replicate's replicas: nodes holding each page, the asking one included


def require_node(who: Identity, what: str) -> None:
    if not who.allows(Rights.NODE):
        raise PermissionDenied(f"{what} is for the nodes of a cluster; tenant {who.tenant!r} lacks the node right")


def acting_for(who: Identity, tenant: str) -> Identity:
    """The identity a node's call acts as: the tenant it names, with read and write (bound
    namespaces, quotas); the node itself when it names none (a cluster without tenants, whose
    callers are all the local tenant)."""
    if not tenant:
        return who
    try:
        check_tenant_name(tenant, "tenant")
    except ConfigError as exc:
        raise InvalidRequest(str(exc)) from None
    return Identity(tenant, NODE_TENANT_RIGHTS, b"", via="node")


def on_behalf(who: Identity) -> str:
    """The tenant this node names when it calls the others for ``who`` (none without tenants)."""
    return "" if who.via == "local" else who.tenant

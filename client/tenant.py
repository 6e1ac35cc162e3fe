"""The tenant's salt folded into the client's namespace (DESIGN §11).

A server with tenants gives each one a secret salt (WhoAmI); the namespace id is computed
with it, so that another tenant can neither compute nor probe this tenant's ids. The
engine configures a Namespace without it; the client fills it in at connect.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvstore.errors import ConfigError
from kvstore.types import Namespace


def tenant_namespace(namespace: Namespace, identity: Any) -> Namespace:
    """``namespace`` with the salt of ``identity`` (a WhoAmIResponse; None or an empty
    salt: a server without tenants, the namespace as given). A namespace that names
    another salt already is a configuration error: its ids would not be this tenant's."""
    if identity is None or not identity.salt:
        return namespace
    salt = identity.salt.hex()
    if namespace.tenant_salt == salt:
        return namespace
    if namespace.tenant_salt:
        raise ConfigError(f"Namespace.tenant_salt is set, but the server gives tenant {identity.tenant!r} another salt; "
                          "leave tenant_salt empty: the client fills it in at connect")
    return dataclasses.replace(namespace, tenant_salt=salt)

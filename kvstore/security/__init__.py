"""Identity and trust: who calls (bearer tokens from --auth-file, client certificates),
as which tenant with which rights, over what (TLS, mTLS), and the refusal to expose an
unprotected server. See README.md in this folder.

Kept light on purpose: kvstore/config.py imports ``kvstore.security.exposure`` while
validating, so this package's ``__init__`` imports nothing that imports the config or gRPC.
"""

from kvstore.security.identity import ALL_RIGHTS, LOCAL_TENANT, Identity, Rights

__all__ = ["ALL_RIGHTS", "LOCAL_TENANT", "Identity", "Rights"]

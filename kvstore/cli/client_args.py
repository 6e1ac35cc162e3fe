"""The options every command-line client shares to reach a server with --auth-file and/or
TLS: a token and the TLS files (kvstore-ctl, kvstore-bench). They are read as the engine
adapters read theirs (kvstore.security.credentials)."""

from __future__ import annotations

import argparse
import os

from kvstore.security.channel import ClientTLS
from kvstore.security.credentials import TOKEN_ENV, TOKEN_FILE_ENV, ClientSecurity


def add_client_security(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("security", "how to reach a server with --auth-file and/or --tls-cert")
    group.add_argument("--token", help=f"bearer token (visible to other users in ps: prefer --token-file, ${TOKEN_ENV} "
                                       f"or ${TOKEN_FILE_ENV})")
    group.add_argument("--token-file", help="read the bearer token from this file")
    group.add_argument("--tls-ca", help="speak TLS; trust server certificates signed by this CA (PEM)")
    group.add_argument("--tls-cert", help="client certificate for mTLS (PEM); implies TLS")
    group.add_argument("--tls-key", help="private key of --tls-cert (PEM)")
    group.add_argument("--tls-server-name", help="name to check in the server's certificate, if not the address's host")


def client_security(args: argparse.Namespace) -> tuple[str | None, ClientTLS | None]:
    """(token, tls) from the options above, ${KVSTORE_TOKEN} and ${KVSTORE_TOKEN_FILE}; raises ConfigError."""
    given = ClientSecurity(args.token, args.token_file, args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name)
    credentials = given.resolve(flag, os.environ)
    return credentials.token, credentials.tls


def flag(name: str) -> str:
    """How the command line spells option ``name``."""
    return "--" + name.replace("_", "-")

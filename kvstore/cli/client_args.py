"""The options every command-line client shares to reach a server with --auth-file and/or
TLS: a token and the TLS files (kvstore-ctl, kvstore-bench)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from kvstore.errors import ConfigError
from kvstore.security.channel import ClientTLS

TOKEN_ENV = "KVSTORE_TOKEN"


def add_client_security(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("security", "how to reach a server with --auth-file and/or --tls-cert")
    group.add_argument("--token", help=f"bearer token (visible to other users in ps: prefer --token-file or ${TOKEN_ENV})")
    group.add_argument("--token-file", help="read the bearer token from this file")
    group.add_argument("--tls-ca", help="speak TLS; trust server certificates signed by this CA (PEM)")
    group.add_argument("--tls-cert", help="client certificate for mTLS (PEM); implies TLS")
    group.add_argument("--tls-key", help="private key of --tls-cert (PEM)")
    group.add_argument("--tls-server-name", help="name to check in the server's certificate, if not the address's host")


def client_security(args: argparse.Namespace) -> tuple[str | None, ClientTLS | None]:
    """(token, tls) from the options above and ${KVSTORE_TOKEN}; raises ConfigError."""
    if args.token and args.token_file:
        raise ConfigError("give --token or --token-file, not both")
    token = args.token or os.environ.get(TOKEN_ENV) or None
    if args.token_file:
        try:
            token = Path(args.token_file).read_text().strip()
        except OSError as exc:
            raise ConfigError(f"--token-file {args.token_file}: cannot read: {exc.strerror or exc}") from None
    tls = None
    if args.tls_ca or args.tls_cert or args.tls_key or args.tls_server_name:
        tls = ClientTLS(ca=_path(args.tls_ca), cert=_path(args.tls_cert), key=_path(args.tls_key),
                        server_name=args.tls_server_name or None)
    return token, tls


def _path(text: str | None) -> Path | None:
    return Path(text) if text else None

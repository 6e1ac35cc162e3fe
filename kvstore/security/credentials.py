"""What a client presents to a server with --auth-file and/or TLS, read from its configuration.

One reading for every front end: kvstore-ctl and kvstore-bench flags, the vLLM connector's
``kv_connector_extra_config`` and the SGLang backend's extra config. Each names its options its
own way (``--token-file``, ``kv_connector_extra_config "token_file"``), and an error names the
option that fixes it. A token comes from the first of: ``token``, ``token_file``,
``$KVSTORE_TOKEN``, ``$KVSTORE_TOKEN_FILE``; an option given beats the environment.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path

from kvstore.errors import ConfigError
from kvstore.security.channel import ClientTLS

TOKEN_ENV = "KVSTORE_TOKEN"
TOKEN_FILE_ENV = "KVSTORE_TOKEN_FILE"


@dataclass(frozen=True)
class Credentials:
    """A token (None: none) and TLS (None: clear text), and ``named_by``: where the token came
    from, or where to give one, for the message of a server that refuses it."""

    token: str | None = field(default=None, repr=False)
    tls: ClientTLS | None = None
    named_by: str = f"${TOKEN_ENV}"


@dataclass(frozen=True)
class ClientSecurity:
    """The options as given (file names as text); ``resolve`` reads them."""

    token: str | None = field(default=None, repr=False)
    token_file: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_server_name: str | None = None

    @classmethod
    def keys(cls) -> set[str]:
        """The option names (the keys of an engine's extra config)."""
        return {f.name for f in fields(cls)}

    @classmethod
    def pop_from(cls, extra: dict[str, object]) -> ClientSecurity:
        """The options taken out of an engine's extra config (the rest stays in ``extra``)."""
        given = {name: extra.pop(name) for name in cls.keys() & extra.keys()}
        for name, value in given.items():
            if value is not None and not isinstance(value, str):
                raise ConfigError(f"{name!r} must be a string, got {type(value).__name__}")
        return cls(**given)  # type: ignore[arg-type]

    def resolve(self, option: Callable[[str], str], environ: Mapping[str, str]) -> Credentials:
        """Reads the token (from its file, or the environment) and checks the TLS files go
        together. ``option(name)`` says how the caller spells an option in an error. Raises
        ConfigError naming the option to fix."""
        if self.token and self.token_file:
            raise ConfigError(f"give {option('token')} or {option('token_file')}, not both")
        if self.token:
            token, named_by = self.token, option("token")
        elif self.token_file:
            token, named_by = _read_token(self.token_file, option("token_file")), option("token_file")
        elif environ.get(TOKEN_ENV):
            token, named_by = environ[TOKEN_ENV], f"${TOKEN_ENV}"
        elif environ.get(TOKEN_FILE_ENV):
            token, named_by = _read_token(environ[TOKEN_FILE_ENV], f"${TOKEN_FILE_ENV}"), f"${TOKEN_FILE_ENV}"
        else:
            token = None
            named_by = f"{option('token')} or {option('token_file')} (or ${TOKEN_ENV} / ${TOKEN_FILE_ENV})"
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError(f"a client certificate ({option('tls_cert')}) and its key ({option('tls_key')}) go together")
        tls = None
        if self.tls_ca or self.tls_cert or self.tls_server_name:
            tls = ClientTLS(ca=_path(self.tls_ca), cert=_path(self.tls_cert), key=_path(self.tls_key),
                            server_name=self.tls_server_name or None)
        return Credentials(token, tls, named_by)


def _read_token(path: str, named_by: str) -> str:
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise ConfigError(f"{named_by} {path}: cannot read: {exc.strerror or exc}") from None
    if not token:
        raise ConfigError(f"{named_by} {path} is empty")
    return token


def _path(text: str | None) -> Path | None:
    return Path(text) if text else None

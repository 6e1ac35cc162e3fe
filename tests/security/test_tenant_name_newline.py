"""check_tenant_name promises "nothing that could forge a line or a label", but its pattern ends
in ``$``, which also matches before a trailing newline: "a\n" is accepted as a tenant name
(distinct from "a") from an auth file, a certificate's common name or a node call's tenant."""

from __future__ import annotations

import pytest

from kvstore.errors import ConfigError
from kvstore.security.identity import check_tenant_name


@pytest.mark.parametrize("name", ["a\n", "tenant-a\n"])
def test_a_tenant_name_with_a_trailing_newline_is_refused(name: str) -> None:
    with pytest.raises(ConfigError):
        check_tenant_name(name, "tenant")


def test_a_token_with_a_trailing_newline_is_refused_by_the_client() -> None:
    """The same ``$`` let "tok\\n" pass the client's token check (an HTTP/2 header value cannot hold it)."""
    from kvstore.security.channel import check_token_route

    with pytest.raises(ConfigError):
        check_token_route("127.0.0.1:7070", "a" * 16 + "\n", None)

"""The --auth-file: TOML and JSON, digests or tokens, expiry, and every mistake refused with
a message naming the entry (a misspelt key must not silently widen access)."""

from __future__ import annotations

import datetime
import hashlib
import logging
from pathlib import Path

import pytest
from support.secure_server import ALICE, BOB, grants, write_auth_file

from kvstore.errors import ConfigError, Unauthenticated
from kvstore.security import Rights, authfile
from kvstore.security.authenticator import Authenticator, PeerCertificate
from kvstore.security.salts import TenantSalts

TOML = f'''
[[tokens]]
tenant = "alice"
rights = ["read", "write"]
sha256 = "{hashlib.sha256(ALICE.encode()).hexdigest()}"
expires = 2100-01-01T00:00:00Z

[[tokens]]
tenant = "bob"
rights = ["read"]
token = "{BOB}"
expires = "1999-12-31T23:59:59+01:00"

[[certs]]
subject = "alice.example"
tenant = "alice"
rights = ["read"]
'''


def test_toml_with_digests_tokens_and_expiry(tmp_path: Path) -> None:
    path = tmp_path / "auth.toml"
    path.write_text(TOML)
    table = authfile.load(path)
    alice, bob = table.find_token(ALICE), table.find_token(BOB)
    assert alice == authfile.Grant("alice", Rights.READ | Rights.WRITE, datetime.datetime(2100, 1, 1, tzinfo=datetime.UTC).timestamp())
    assert bob is not None and bob.rights == Rights.READ and bob.expired(datetime.datetime(2000, 1, 1, tzinfo=datetime.UTC).timestamp())
    assert table.find_token("nobody-0123456789abcdef") is None
    assert table.find_cert(["x", "alice.example"]) == [authfile.Grant("alice", Rights.READ)]
    assert table.tenants() == {"alice", "bob"}


def test_json_is_the_same_table(tmp_path: Path) -> None:
    table = authfile.load(write_auth_file(tmp_path / "auth.json", grants()))
    assert table.find_token(ALICE) == authfile.Grant("alice", Rights.READ | Rights.WRITE)
    assert len(table.tokens) == 4 and table.tenants() == {"alice", "bob", "ops"}


def test_only_digests_are_kept(tmp_path: Path) -> None:
    table = authfile.load(write_auth_file(tmp_path / "auth.json", grants()))
    assert all(len(key) == 32 for key in table.tokens)
    assert ALICE not in repr(table) and ALICE.encode() not in b"".join(table.tokens)


@pytest.mark.parametrize(("entry", "message"), [
    ({"tenant": "a", "rights": ["read"], "token": ALICE, "expire": 1}, r"unknown key\(s\) \['expire'\]"),
    ({"tenant": "a", "rights": ["read"]}, "exactly one of token"),
    ({"tenant": "a", "rights": ["read"], "token": ALICE, "sha256": "00" * 32}, "exactly one of token"),
    ({"tenant": "a", "rights": ["read"], "token": "short"}, "16-4096 printable"),
    ({"tenant": "a", "rights": ["read"], "token": "has a space 0123456789"}, "16-4096 printable"),
    ({"tenant": "a", "rights": ["read"], "sha256": "abc"}, "64 hex digits"),
    ({"tenant": "a", "rights": ["root"], "token": ALICE}, "unknown right 'root'"),
    ({"tenant": "a", "rights": [], "token": ALICE}, "at least one"),
    ({"tenant": "a", "rights": "read", "token": ALICE}, "must be a list"),
    ({"tenant": "a b", "rights": ["read"], "token": ALICE}, "tenant must be"),
    ({"rights": ["read"], "token": ALICE}, "tenant must be"),
    ({"tenant": "a", "rights": ["read"], "token": ALICE, "expires": "2030-01-01T00:00:00"}, "no UTC offset"),
    ({"tenant": "a", "rights": ["read"], "token": ALICE, "expires": "tomorrow"}, "not an RFC 3339 time"),
    ({"tenant": "a", "rights": ["read"], "token": ALICE, "expires": True}, "must be a time"),
])
def test_a_bad_token_entry_is_refused_naming_it(tmp_path: Path, entry: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=r"tokens\[1\]: .*" + message):
        authfile.load(write_auth_file(tmp_path / "auth.json", [grants()[1], entry]))


def test_other_mistakes_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "auth.toml"
    for text, message in (("[[token]]\ntenant = 'a'", r"unknown key\(s\) \['token'\]"), ("tokens = 3", "list of tables"),
                          ("[[certs]]\ntenant = 'a'\nrights = ['read']", "subject"),
                          (f"[[tokens]]\ntenant = 'a'\nrights = ['read']\nexpires = 2030-01-01T00:00:00\ntoken = '{ALICE}'",
                           "no UTC offset"),
                          ("tokens = [", "not valid TOML")):
        path.write_text(text)
        with pytest.raises(ConfigError, match=message):
            authfile.load(path)
    twice = [grants()[0], {**grants()[1], "token": ALICE}]
    with pytest.raises(ConfigError, match="the same token appears twice"):
        authfile.load(write_auth_file(tmp_path / "auth.json", twice))


def test_clear_text_tokens_in_a_readable_file_are_warned_about(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = write_auth_file(tmp_path / "auth.json", grants())
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="kvstore.security.authfile"):
        authfile.load(path)
    assert "chmod 600" in caplog.text


def test_new_token_entry_grants_the_new_token(tmp_path: Path) -> None:
    token = authfile.new_token()
    assert len(token) >= 43
    path = tmp_path / "auth.toml"
    path.write_text(authfile.token_entry("alice", Rights.READ | Rights.ADMIN, token))
    assert authfile.load(path).find_token(token) == authfile.Grant("alice", Rights.READ | Rights.ADMIN)
    assert token not in path.read_text()


def test_authenticate_header_forms_and_expiry(tmp_path: Path) -> None:
    path = tmp_path / "auth.toml"
    path.write_text(TOML)
    auth = Authenticator(path, TenantSalts(tmp_path / "data"))
    assert auth.authenticate([f"Bearer {ALICE}"], None).tenant == "alice"
    assert auth.authenticate([f"bearer  {ALICE} "], None).tenant == "alice"
    year_2000 = datetime.datetime(2000, 1, 1, tzinfo=datetime.UTC).timestamp()
    assert auth.authenticate([f"Bearer {BOB}"], None, now_unix_s=year_2000 - 86400 * 365).tenant == "bob"
    for header, message in (([f"Bearer {BOB}"], "expired"), ([f"Basic {ALICE}"], "Bearer <token>"),
                            (["Bearer"], "Bearer <token>"), ([f"Bearer {ALICE}", f"Bearer {ALICE}"], "more than one"),
                            ([], "no credential")):
        with pytest.raises(Unauthenticated, match=message):
            auth.authenticate(header, None, now_unix_s=year_2000)
    with pytest.raises(Unauthenticated, match="no credential"):
        auth.authenticate([], PeerCertificate("alice.example"))  # certificates count only with --tls-client-ca


def test_certificate_names(tmp_path: Path) -> None:
    path = tmp_path / "auth.toml"
    path.write_text(TOML + '\n[[certs]]\nsubject = "shared.example"\ntenant = "bob"\nrights = ["read"]\n')
    auth = Authenticator(path, TenantSalts(tmp_path / "data"), trust_certs=True)
    assert auth.authenticate([], PeerCertificate("laptop", ("alice.example",))).tenant == "alice"
    with pytest.raises(Unauthenticated, match="several tenants"):
        auth.authenticate([], PeerCertificate("alice.example", ("shared.example",)))
    with pytest.raises(Unauthenticated, match="no --auth-file certs entry"):
        auth.authenticate([], PeerCertificate("stranger"))


def test_reload_swaps_the_table_or_keeps_it(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = write_auth_file(tmp_path / "auth.json", grants())
    auth = Authenticator(path, TenantSalts(tmp_path / "data"))
    salt = auth.authenticate([f"Bearer {ALICE}"], None).salt
    write_auth_file(path, [g for g in grants() if g["token"] != ALICE])
    assert auth.reload()
    with pytest.raises(Unauthenticated, match="unknown token"):
        auth.authenticate([f"Bearer {ALICE}"], None)
    path.write_text("{")
    with caplog.at_level(logging.ERROR):
        assert not auth.reload()
    assert "reload refused" in caplog.text
    assert auth.authenticate([f"Bearer {BOB}"], None).tenant == "bob"
    write_auth_file(path, grants())
    assert auth.reload() and auth.authenticate([f"Bearer {ALICE}"], None).salt == salt, "a tenant keeps its salt"

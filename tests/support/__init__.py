"""Helpers the tests share, imported as ``from support.<module> import ...`` (never from conftest,
which keeps the fixtures). tests/ is on sys.path through pyproject's [tool.pytest.ini_options]
``pythonpath = ["tests"]``; a child process a test starts puts it there itself.

servers (make_config, ServerProcess, flip_arena_byte), kv (SMALL, random_kv), hf_model (a tiny
random Qwen3), changing_arena (an arena another process changes), certs (a test CA), secure_server
(auth files, secured configs, a call of every RPC), tenants (two tenants on one server; also a
pytest plugin: ``pytest_plugins = ["support.tenants"]`` for its fixtures), callsock (raw call-socket
frames), etcd_proc (a real etcd; its ``etcd`` fixture), cluster_nodes (nodes of one cluster; its
``cluster_nodes`` fixture), tcp_proxy (a TCP proxy a test can cut)."""

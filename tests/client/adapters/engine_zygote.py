"""Engine processes forked from one that imported vLLM already (the tests' side: ``spawn``).

A vLLM-CPU engine process spends ~12 CPU seconds importing vLLM before it builds anything, and the suite
boots about thirty of them: on CI's 2 cores that was minutes of its 30. The zygote imports vLLM once, then
forks a child per engine, which runs ``vllm_engine.py`` with the stdin, stdout and stderr the test passed
(over a Unix socket, SCM_RIGHTS) in the environment it named. The zygote is single-threaded when it forks
(native threads torch starts at import are not carried over, as with a DataLoader's workers).

    python engine_zygote.py SOCKET_PATH      prints "ready" once it listens; ends when its stdin closes

Per connection: one JSON header {"argv", "env", "cwd"} with three descriptors -> {"pid"}; later {"exit": code}
once the child ended. A connection closed by the test side kills its child.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import sys


def _run_child(request: dict, fds: list[int]) -> None:
    """In the forked child: becomes ``python argv...`` with the test's descriptors and environment; never returns."""
    code = 1
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the process's own streams
        sys.stdout = open(1, "w", closefd=False, buffering=1)  # noqa: SIM115
        sys.stderr = open(2, "w", closefd=False, buffering=1)  # noqa: SIM115
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        script = request["argv"][0]
        sys.argv = list(request["argv"])
        sys.path[:0] = [os.path.dirname(script), *(p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p)]
        import runpy

        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - whatever ended it, the child exits here and says why
        import traceback

        traceback.print_exc()
    from kvstore.bench.common.harness import exit_now

    exit_now(code)  # threads joined, atexit handlers run, streams flushed; no interpreter teardown


def serve(path: str) -> None:
    for name, value in (("HF_HUB_OFFLINE", "1"), ("VLLM_CPU_KVCACHE_SPACE", "1"), ("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
                        ("VLLM_ENABLE_V1_MULTIPROCESSING", "0")):  # vllm_engine.py's, before vLLM reads any
        os.environ.setdefault(name, value)
    import torch  # noqa: F401  # what every engine imports first, and the bulk of the time
    import vllm  # noqa: F401
    from vllm import LLM, SamplingParams  # noqa: F401

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # only to wake the selector
    children: dict[int, socket.socket] = {}  # pid -> its test-side connection
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(wake_r, selectors.EVENT_READ, "reap")
    selector.register(sys.stdin, selectors.EVENT_READ, "stdin")
    print("ready", flush=True)
    try:
        while True:
            for key, _ in selector.select():
                if key.data == "stdin" and not sys.stdin.buffer.read1(4096):
                    return  # the test process ended
                if key.data == "accept":
                    conn, _ = listener.accept()
                    _spawn(conn, children, selector, [listener, *children.values()], (wake_r, wake_w))
                elif key.data == "reap":
                    _reap(children, selector, wake_r)
                elif isinstance(key.data, int) and not key.fileobj.recv(1):  # type: ignore[union-attr]
                    _kill(key.data)  # its test side closed the connection: the child goes too
                    selector.unregister(key.fileobj)
    finally:
        for pid in children:
            _kill(pid)
        os.unlink(path)


def _spawn(conn: socket.socket, children: dict[int, socket.socket], selector: selectors.BaseSelector,
           others: list[socket.socket], wake: tuple[int, int]) -> None:
    message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    request = json.loads(message)
    if len(fds) != 3:
        conn.sendall(json.dumps({"error": f"{len(fds)} descriptors, not 3"}).encode() + b"\n")
        conn.close()
        return
    pid = os.fork()
    if pid == 0:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for sock in (*others, conn):
            sock.close()
        for fd in wake:
            os.close(fd)
        _run_child(request, fds)
    for fd in fds:
        os.close(fd)
    children[pid] = conn
    selector.register(conn, selectors.EVENT_READ, pid)
    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")


def _reap(children: dict[int, socket.socket], selector: selectors.BaseSelector, wake_r: int) -> None:
    try:
        os.read(wake_r, 4096)
    except BlockingIOError:
        pass
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            try:
                selector.unregister(conn)
            except (KeyError, ValueError):
                pass
            try:
                conn.sendall(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
            except OSError:
                pass
            conn.close()


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


if __name__ == "__main__":
    serve(sys.argv[1])

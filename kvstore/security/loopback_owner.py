"""Whose sockets hold a loopback TCP port, asked before a client sends a token there in clear text.

More: kvstore/security/README.md (### loopback_owner.py).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

from kvstore.errors import KVStoreError

PROC_NET = Path("/proc/net")
TCP_LISTEN = 10  # include/net/tcp_states.h
_SOCK_DIAG_BY_FAMILY = 20
_NETLINK_SOCK_DIAG = 4
_NLM_F_REQUEST, _NLM_F_DUMP = 0x1, 0x300
_NLMSG_ERROR, _NLMSG_DONE = 2, 3
_NLMSG = struct.Struct("=IHHII")  # len, type, flags, seq, pid
_DIAG_REQ = struct.Struct("=BBBBI48x")  # family, protocol, ext, pad, states; the socket id left zero: a dump
_DIAG_MSG = struct.Struct("=BBBB2s2s16s16s4x8x12xII")  # family, state, timer, retrans, sport, dport, src, dst, if, cookie, ..., uid, inode

IP = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True)
class TcpSocket:
    """One row of the kernel's TCP socket table (uid 0 for a TIME_WAIT one: it has no owner)."""

    ip: IP
    port: int
    listening: bool
    uid: int
    inode: int


class TokenWithheld(KVStoreError):
    """A token was not sent: another uid holds the loopback port, or nobody can tell who does.
    Nothing left the process."""


def loopback_port(address: str) -> int | None:
    """The port of a loopback TCP gRPC target (``127.0.0.1:7070``, ``[::1]:7070``,
    ``ipv4:…``, ``dns:///localhost:7070``); None for a Unix socket."""
    if address.startswith(("unix:", "unix-abstract:")):
        return None
    if address.startswith(("ipv4:", "ipv6:", "dns:")):
        address = address.split(":", 1)[1].lstrip("/")
    _, sep, port = address.rpartition(":")
    return int(port) if sep and port.isdigit() else 443  # gRPC's default port


def _on_loopback(ip: IP) -> bool:
    """Whether a socket bound to ``ip`` takes connections made to a loopback address."""
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return any(a.is_loopback or a.is_unspecified for a in (ip, mapped) if a is not None)


def _diag(family: int, states: int) -> list[TcpSocket]:
    """The TCP sockets of ``family`` in ``states`` (a bit per state), from a sock_diag dump."""
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_SOCK_DIAG) as nl:
        request = _DIAG_REQ.pack(family, socket.IPPROTO_TCP, 0, 0, states)
        nl.sendto(_NLMSG.pack(_NLMSG.size + len(request), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST | _NLM_F_DUMP, 1, 0) + request,
                  (0, 0))
        found: list[TcpSocket] = []
        while True:
            data, offset = nl.recv(1 << 16), 0
            while offset + _NLMSG.size <= len(data):
                length, kind, _, _, _ = _NLMSG.unpack_from(data, offset)
                if kind == _NLMSG_DONE:
                    return found
                if kind == _NLMSG_ERROR:
                    (errno,) = struct.unpack_from("=i", data, offset + _NLMSG.size)
                    raise OSError(-errno, f"sock_diag: {os.strerror(-errno)}")
                if length < _NLMSG.size + _DIAG_MSG.size:
                    raise OSError(f"sock_diag: a reply of {length} bytes")
                fam, state, _, _, sport, _, src, _, uid, inode = _DIAG_MSG.unpack_from(data, offset + _NLMSG.size)
                ip = ipaddress.ip_address(src[:4] if fam == socket.AF_INET else src)
                found.append(TcpSocket(ip, int.from_bytes(sport, "big"), state == TCP_LISTEN, uid, inode))
                offset += (length + 3) & ~3


def _proc() -> list[TcpSocket]:
    """Every TCP socket, from /proc/net/tcp and tcp6 (addresses in hex, each 32-bit word in host order)."""
    found: list[TcpSocket] = []
    for name in ("tcp", "tcp6"):
        for line in (PROC_NET / name).read_text().splitlines()[1:]:
            fields = line.split()
            ip_hex, port_hex = fields[1].split(":")
            raw = b"".join(bytes.fromhex(ip_hex[i:i + 8])[::-1] for i in range(0, len(ip_hex), 8))
            found.append(TcpSocket(ipaddress.ip_address(raw), int(port_hex, 16), int(fields[3], 16) == TCP_LISTEN,
                                   int(fields[7]), int(fields[9])))
    return found


def _sockets(listening_only: bool) -> list[TcpSocket]:
    """The table's sockets (only the listening ones, when that is cheaper to ask); raises OSError
    when it cannot be read at all."""
    if hasattr(socket, "AF_NETLINK"):
        states = 1 << TCP_LISTEN if listening_only else 0xFFFFFFFF
        try:
            return _diag(socket.AF_INET, states) + _diag(socket.AF_INET6, states)
        except OSError:
            pass  # sock_diag not allowed here (a sandbox): the /proc table says the same, slower
    return _proc()


class LoopbackOwner:
    """Checks, before each call, that the sockets on a loopback TCP port belong to this uid or root.

    Thread-safe without a lock: the only state is the set of listeners last found good, replaced
    whole; two callers racing on it at worst both read the whole table.
    """

    def __init__(self, address: str, port: int) -> None:
        self.address = address
        self.port = port
        self._good: frozenset[int] = frozenset()  # inodes of the listeners the last full check passed

    def check(self) -> None:
        """Raises TokenWithheld unless every socket on the port is this uid's or root's."""
        listening = self._at_port(listening_only=True)
        self._refuse_foreign(listening)
        inodes = frozenset(s.inode for s in listening if s.listening)
        if inodes and inodes == self._good:
            return
        every = self._at_port(listening_only=False)
        self._refuse_foreign(every)
        # Nothing listening is never taken as good: a connection gRPC still holds could be to a
        # listener that is gone, so each call reads the whole table until the server is back.
        self._good = frozenset(s.inode for s in every if s.listening)

    def _at_port(self, *, listening_only: bool) -> list[TcpSocket]:
        try:
            table = _sockets(listening_only)
        except (OSError, ValueError, IndexError) as exc:
            raise TokenWithheld(f"token withheld from {self.address}: cannot tell who listens there (no sock_diag, no "
                                f"readable {PROC_NET}/tcp: {exc}); to send a token to it, connect with TLS "
                                "(tls=/--tls-ca)") from None
        return [s for s in table if s.port == self.port and (s.listening or not listening_only) and _on_loopback(s.ip)]

    def _refuse_foreign(self, sockets: list[TcpSocket]) -> None:
        me = os.getuid()
        for s in sockets:
            if s.uid not in (me, 0):
                held = "listens on" if s.listening else "holds a connection on"
                raise TokenWithheld(f"token withheld from {self.address}: a socket of uid {s.uid} {held} {s.ip}:{self.port}, "
                                    f"not this uid ({me}) nor root (another user may have bound the port while the server "
                                    "was down; check who serves it, or use TLS)")

"""Refusing a taken port at start-up, before anything slow happens.

The servers bind their ports only once they are ready to serve: a worker after loading its
model, which can take minutes, and the router's HTTP API after its gRPC server. A taken port
would be found that late, or (with `serve --role all`) not at all: the router would talk to
whatever listens on the worker's port. So each command first tries every port it will
listen on, the way its servers will bind it.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Sequence

# (flag, host, port): a port a process will listen on, named by the flag that set it.
Listener = tuple[str, str, int]


def check_ports(listeners: Sequence[Listener]) -> None:
    """Raises OSError naming the flag of the first port that cannot be listened on, or that
    two flags share. A port of 0 (a free one) or below (off) is not checked."""
    flags_by_port: dict[int, str] = {}
    for flag, host, port in listeners:
        if port <= 0:
            continue
        if port in flags_by_port:   # on two hosts too: the default one, 0.0.0.0, is every host
            raise OSError(f"{flag} {port} is also {flags_by_port[port]}; give each its own port")
        flags_by_port[port] = flag
        problem = _bind_problem(host, port)
        if problem is not None:
            raise OSError(f"{flag} {port} {problem}; choose another port")


def _bind_problem(host: str, port: int) -> str | None:
    """Why binding host:port fails now, or None. Binds as gRPC, aiohttp and prometheus_client
    do: with SO_REUSEADDR, so that a port whose last connections linger in TIME_WAIT counts as
    free (as it is for them), and without SO_REUSEPORT (grpc_server.create_server turns it off)."""
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                       flags=socket.AI_PASSIVE)
    except socket.gaierror as error:
        return f"cannot be listened on: host {host!r} is unknown ({error.strerror})"
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(address)
            except OSError as error:
                if error.errno == errno.EADDRINUSE:
                    return "is already in use (another server is listening there)"
                return f"cannot be listened on at {host}: {error.strerror}"
    return None

"""What every gRPC server pagedserve starts has in common: it owns its port."""

from __future__ import annotations

from collections.abc import Sequence

import grpc


def create_server(options: list[tuple[str, object]],
                  interceptors: Sequence[grpc.aio.ServerInterceptor] = ()) -> grpc.aio.Server:
    """A grpc.aio server with `options` and `interceptors`, which refuses to share its port.
    gRPC sets SO_REUSEPORT by default on Linux, so a second server told a port that is already
    taken would start without error and the kernel would split connections between the two."""
    return grpc.aio.server(interceptors=interceptors,
                           options=[*options, ("grpc.so_reuseport", 0)])


def listen(server: grpc.aio.Server, host: str, port: int,
           credentials: grpc.ServerCredentials | None = None) -> int:
    """Binds server to host:port (0: a free port), with TLS if given credentials, and returns
    the port, or raises OSError naming the address."""
    address = f"{host}:{port}"
    try:
        bound = (server.add_secure_port(address, credentials) if credentials is not None
                 else server.add_insecure_port(address))
    except RuntimeError:    # what grpcio raises when bind() fails
        bound = 0
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}: the port is taken or not allowed")
    return bound

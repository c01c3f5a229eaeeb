"""What every gRPC server pagedserve starts has in common: it owns its port."""

from collections.abc import Sequence

import grpc


def create_server(options: list[tuple[str, object]],
                  interceptors: Sequence[grpc.aio.ServerInterceptor] = ()) -> grpc.aio.Server:
    """A grpc.aio server with `options` and `interceptors`, which refuses to share its port.
    gRPC sets SO_REUSEPORT by default on Linux, so a second server told a port that is already
    taken would start without error and the kernel would split connections between the two."""
    return grpc.aio.server(interceptors=interceptors,
                           options=[*options, ("grpc.so_reuseport", 0)])


def listen(server: grpc.aio.Server, host: str, port: int) -> int:
    """Binds server to host:port (0: a free port) and returns the port, or raises OSError
    naming the address."""
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:    # what grpcio raises when bind() fails
        bound = 0
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}: the port is taken or not allowed")
    return bound

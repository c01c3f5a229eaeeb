"""What every gRPC server pagedserve starts has in common: an exclusive port."""

import grpc

# gRPC sets SO_REUSEPORT by default on Linux, so a second server told a port that is already
# taken starts without error and the kernel splits connections between the two. A worker or
# router must own its port: refusing it makes a misconfigured port fail at startup.
EXCLUSIVE_PORT = [("grpc.so_reuseport", 0)]


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

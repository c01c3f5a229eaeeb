"""router.server: the router's own gRPC port."""

import asyncio

import pytest


def test_router_refuses_a_port_another_server_holds():
    """gRPC's default SO_REUSEPORT would let both serve and split the connections."""
    from router.server import Router, RouterConfig

    async def scenario() -> None:
        first = Router(RouterConfig(workers=[], host="127.0.0.1", port=0, shutdown_grace_s=0.1))
        await first.start()
        try:
            second = Router(RouterConfig(workers=[], host="127.0.0.1", port=first.port))
            with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{first.port}"):
                await second.start()
        finally:
            await first.stop()
    asyncio.run(scenario())

"""router.discovery: static, DNS and Kubernetes (EndpointSlice) worker targets; the
EndpointSlice lookup itself is tested against an API server in test_endpoint_slices."""

import asyncio
import socket

import pytest

from router.discovery import Discovery, Target, format_address, parse_target, resolve


# Discovery

class Recorder:
    """A discovery callback that records the changes it is told about."""

    def __init__(self):
        self.changes = []

    def __call__(self, added, removed):
        self.changes.append((added, removed))


@pytest.mark.parametrize("spec, target", [
    ("worker-0:50061", Target("worker-0", 50061)),
    ("[::1]:50061", Target("::1", 50061)),
    ("dns:workers.svc:50061", Target("workers.svc", 50061, "dns")),
    ("dns:///workers.svc:50061", Target("workers.svc", 50061, "dns")),
    ("k8s:workers.serving:50061", Target("workers.serving", 50061, "k8s")),
    ("k8s:///workers:50061", Target("workers", 50061, "k8s")),
])
def test_parse_target_accepts_static_dns_and_k8s_forms(spec, target):
    assert parse_target(spec) == target


@pytest.mark.parametrize("spec", ["worker-0", "worker-0:http", ":50061", "dns:host:0", "k8s:workers"])
def test_parse_target_rejects_bad_target_naming_it(spec):
    with pytest.raises(ValueError, match="worker target"):
        parse_target(spec)


def test_ipv6_addresses_are_bracketed():
    assert format_address("fd00::7", 50061) == "[fd00::7]:50061"
    assert format_address("10.0.0.7", 50061) == "10.0.0.7:50061"


def test_static_targets_are_reported_once_as_given():
    async def scenario():
        changes = Recorder()
        discovery = Discovery(["localhost:1", "10.0.0.2:2"], changes)
        await discovery.refresh()
        await discovery.refresh()
        assert changes.changes == [({"localhost:1", "10.0.0.2:2"}, set())]
    asyncio.run(scenario())


def test_dns_discovery_resolves_localhost():
    async def scenario():
        changes = Recorder()
        await Discovery(["dns:localhost:50061"], changes).refresh()
        assert changes.changes in ([({"127.0.0.1:50061"}, set())],
                                   [({"[::1]:50061"}, set())])
    asyncio.run(scenario())


def test_dns_discovery_reports_added_and_removed():
    async def scenario():
        records = {"10.0.0.1", "10.0.0.2"}

        async def resolver(host, port):
            assert (host, port) == ("workers.svc", 7)
            return {f"{ip}:{port}" for ip in records}

        changes = Recorder()
        discovery = Discovery(["dns:workers.svc:7"], changes, resolvers={"dns": resolver})
        await discovery.refresh()
        records.discard("10.0.0.1")
        records.add("10.0.0.3")
        await discovery.refresh()
        await discovery.refresh()
        assert changes.changes == [({"10.0.0.1:7", "10.0.0.2:7"}, set()),
                                   ({"10.0.0.3:7"}, {"10.0.0.1:7"})]
        assert discovery.addresses == {"10.0.0.2:7", "10.0.0.3:7"}
    asyncio.run(scenario())


def test_dns_failure_keeps_last_known_addresses():
    async def scenario():
        failing = False

        async def resolver(host, port):
            if failing:
                raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
            return {f"10.0.0.1:{port}"}

        changes = Recorder()
        discovery = Discovery(["dns:workers.svc:7"], changes, resolvers={"dns": resolver})
        await discovery.refresh()
        failing = True
        await discovery.refresh()
        assert discovery.addresses == {"10.0.0.1:7"} and len(changes.changes) == 1
    asyncio.run(scenario())


def test_dns_name_without_addresses_means_no_workers(monkeypatch):
    def no_such_name(*args):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_such_name)
    assert asyncio.run(resolve("workers.svc", 7)) == set()


def test_discovery_outlives_a_refresh_that_fails_unexpectedly(caplog):
    """A resolver bug (not an OSError) is logged; the next refresh still follows the name."""
    async def scenario():
        calls = 0

        async def resolver(host, port):
            nonlocal calls
            calls += 1
            if calls == 1:
                raise UnicodeError("label too long")
            return {f"10.0.0.{calls}:{port}"}

        changes = Recorder()
        task = asyncio.create_task(Discovery(["dns:workers.svc:7"], changes, refresh_s=0.01,
                                             resolvers={"dns": resolver}).run())
        while len(changes.changes) < 2:
            await asyncio.sleep(0.01)
        task.cancel()
        assert changes.changes[:2] == [({"10.0.0.2:7"}, set()), ({"10.0.0.3:7"}, {"10.0.0.2:7"})]
    asyncio.run(asyncio.wait_for(scenario(), 10))
    assert "refreshing the worker addresses failed" in caplog.text and "label too long" in caplog.text

"""Where the workers are: addresses given as is, or names looked up again every few seconds.

A target is "host:port", one worker at that address; "dns:host:port" (also spelt
"dns:///host:port", as in gRPC target names), every address the name resolves to being a worker:
a Kubernetes headless Service resolves to one A record per ready pod; or
"k8s:service[.namespace]:port", every ready endpoint of the Service's EndpointSlices, from the
Kubernetes API (router.endpoint_slices). Names are looked up every refresh_s seconds and the
changes reach a callback as added and removed addresses.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

from router.endpoint_slices import ApiServer, EndpointSlices

log = logging.getLogger(__name__)

# Resolves (host, port) to worker addresses ("ip:port"); raises OSError when it cannot tell.
# One per scheme of target: "dns", "k8s".
Resolver = Callable[[str, int], Awaitable[set[str]]]

# Called with (added, removed) addresses whenever the set of workers changes.
ChangeCallback = Callable[[set[str], set[str]], None]

# getaddrinfo errors that answer "this name has no addresses", as opposed to "could not find out".
_NO_ADDRESSES = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}

SCHEMES = ("dns", "k8s")


@dataclass(frozen=True)
class Target:
    """One entry of the worker list."""

    host: str
    port: int
    # How host names its workers, looked up again at every refresh: "dns" (every address it
    # resolves to), "k8s" (a Service's ready endpoints); "": host is one worker's address.
    scheme: str = ""


def parse_target(spec: str) -> Target:
    """Parses "host:port", "[ipv6]:port", "dns:host:port", "k8s:service.namespace:port" (each
    scheme also as "scheme:///...")."""
    scheme, colon, rest = spec.partition(":")
    if scheme not in SCHEMES or not colon:
        scheme, rest = "", spec
    host, colon, port = rest.removeprefix("///").rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"worker target {spec!r} is invalid: expected host:port, dns:host:port "
                         "or k8s:service.namespace:port with a port in [1, 65535]")
    return Target(host, int(port), scheme)


def format_address(host: str, port: int) -> str:
    """host:port, with IPv6 literals bracketed as gRPC expects."""
    try:
        is_ipv6 = ipaddress.ip_address(host.split("%")[0]).version == 6
    except ValueError:
        is_ipv6 = False
    return f"[{host}]:{port}" if is_ipv6 else f"{host}:{port}"


async def resolve(host: str, port: int) -> set[str]:
    """The addresses of host as "ip:port", from getaddrinfo in a thread (it blocks).

    Returns addresses of one family only, IPv4 when there is any: in a dual-stack cluster each
    pod has an address of each family and must count as one worker, not two.
    """
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.run_in_executor(
            None, socket.getaddrinfo, host, port, socket.AF_UNSPEC, socket.SOCK_STREAM)
    except socket.gaierror as error:
        if error.errno in _NO_ADDRESSES:  # e.g. a headless Service with no ready pod
            return set()
        raise
    ipv4 = {info[4][0] for info in infos if info[0] == socket.AF_INET}
    ipv6 = {info[4][0] for info in infos if info[0] == socket.AF_INET6}
    return {format_address(ip, port) for ip in ipv4 or ipv6}


def kubernetes_resolver(slices: EndpointSlices) -> Resolver:
    """Resolves "service[.namespace]" to the addresses of the Service's ready endpoints."""
    async def resolve_service(name: str, port: int) -> set[str]:
        return {format_address(ip, port) for ip in await slices.ready_ips(name)}
    return resolve_service


class Discovery:
    """Keeps the set of worker addresses current and reports its changes."""

    def __init__(self, targets: Sequence[str], on_change: ChangeCallback,
                 refresh_s: float = 10.0, resolvers: Mapping[str, Resolver] | None = None) -> None:
        """`resolvers`: by scheme; default: DNS, and this pod's Kubernetes API (which it
        checks for now, when a target needs it: ValueError outside a pod)."""
        parsed = [parse_target(spec) for spec in targets]
        self._static = {format_address(t.host, t.port) for t in parsed if not t.scheme}
        self._names = [t for t in parsed if t.scheme]
        self._on_change = on_change
        self._resolvers = {"dns": resolve, **(resolvers or {})}
        if "k8s" not in self._resolvers and any(t.scheme == "k8s" for t in self._names):
            self._resolvers["k8s"] = kubernetes_resolver(EndpointSlices(ApiServer.in_cluster()))
        self.refresh_s = refresh_s
        self._resolved: dict[Target, set[str]] = {t: set() for t in self._names}
        self.addresses: frozenset[str] = frozenset()

    async def run(self) -> None:
        """Refreshes every refresh_s seconds until cancelled. A refresh that fails unexpectedly
        is logged and tried again at the next one: were discovery to end, the router would not
        see a worker come or go again until it restarted."""
        while True:
            try:
                await self.refresh()
            except Exception:
                log.exception("refreshing the worker addresses failed; trying again in %g s",
                              self.refresh_s)
            await asyncio.sleep(self.refresh_s)

    async def refresh(self) -> None:
        """Resolves the names once and reports any change. A name that fails to resolve keeps
        its last addresses: a DNS hiccup must not look like every worker leaving."""
        results = await asyncio.gather(*(self._resolvers[t.scheme](t.host, t.port)
                                         for t in self._names), return_exceptions=True)
        for target, result in zip(self._names, results):
            if isinstance(result, OSError):
                log.warning("resolving worker target %s:%s:%s failed, keeping %d known "
                            "addresses: %s", target.scheme, target.host, target.port,
                            len(self._resolved[target]), result)
            elif isinstance(result, BaseException):
                raise result
            else:
                self._resolved[target] = result
        current = frozenset(self._static.union(*self._resolved.values()))
        added, removed = current - self.addresses, self.addresses - current
        self.addresses = current
        if added or removed:
            self._on_change(set(added), set(removed))

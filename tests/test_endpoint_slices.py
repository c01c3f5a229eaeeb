"""Discovery through the Kubernetes API (router.endpoint_slices, "k8s:" worker targets), against
a stand-in for the API server: an HTTPS server on loopback with a certificate of its own CA,
answering the EndpointSlice list as the API server does (label selector, bearer token, Status
objects for errors). No Kubernetes runs here; the discovery code is the router's own, up to a
router that follows a real worker in and out of its Service's ready endpoints."""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc
import pytest

from certificates import KeyPair, make_ca
from common.pb import generation_pb2 as pb
from common.pb import generation_pb2_grpc
from router import endpoint_slices
from router.discovery import Discovery, kubernetes_resolver
from router.endpoint_slices import ApiServer, EndpointSlices
from router.fleet import FleetConfig
from router.server import Router, RouterConfig
from worker_process import WorkerProcess

NAMESPACE = "serving"
LIST_PATH = "/apis/discovery.k8s.io/v1/namespaces/{}/endpointslices"


def endpoint_slice(service: str, family: str, endpoints: dict[str, dict], name: str = "") -> dict:
    """An EndpointSlice of `service` with one endpoint per address, with those conditions."""
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": name or f"{service}-{family.lower()}", "namespace": NAMESPACE,
                         "labels": {"kubernetes.io/service-name": service}},
            "addressType": family, "ports": [{"name": "grpc", "port": 50061, "protocol": "TCP"}],
            "endpoints": [{"addresses": [address], "conditions": conditions}
                          for address, conditions in endpoints.items()]}


class FakeApiServer:
    """Answers GET .../namespaces/NS/endpointslices?labelSelector=kubernetes.io/service-name=S
    with the slices of S in NS, to requests bearing the token in token_file; records each
    request's path, selector and token."""

    def __init__(self, pair: KeyPair, token_file: Path) -> None:
        self.slices: list[dict] = []
        self.requests: list[tuple[str, str, str]] = []
        self.token_file = token_file
        self.refuse: tuple[int, str] | None = None   # (HTTP status, message) to answer instead
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                url = urllib.parse.urlsplit(self.path)
                selector = urllib.parse.parse_qs(url.query).get("labelSelector", [""])[0]
                token = self.headers.get("Authorization", "").removeprefix("Bearer ")
                server.requests.append((url.path, selector, token))
                if token != server.token_file.read_text().strip():
                    return self._status(401, "Unauthorized")
                if server.refuse is not None:
                    return self._status(*server.refuse)
                namespace = url.path.split("/")[5] if url.path.count("/") == 6 else ""
                if url.path != LIST_PATH.format(namespace):
                    return self._status(404, "the server could not find the requested resource")
                service = selector.removeprefix("kubernetes.io/service-name=")
                items = [s for s in server.slices if s["metadata"]["namespace"] == namespace
                         and s["metadata"]["labels"]["kubernetes.io/service-name"] == service]
                self._reply(200, {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSliceList",
                                  "metadata": {"resourceVersion": "1"}, "items": items})

            def _status(self, code: int, message: str) -> None:
                self._reply(code, {"apiVersion": "v1", "kind": "Status", "status": "Failure",
                                   "message": message, "code": code})

            def _reply(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        self._http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(pair.cert, pair.key)
        self._http.socket = context.wrap_socket(self._http.socket, server_side=True)
        self.url = f"https://127.0.0.1:{self._http.server_address[1]}"
        self._thread = threading.Thread(target=self._http.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()


@pytest.fixture
def account(tmp_path) -> Path:
    """A service account mount as the kubelet makes it: token, ca.crt (the API server's CA), namespace."""
    directory = tmp_path / "serviceaccount"
    ca = make_ca(tmp_path / "pki")
    directory.mkdir()
    (directory / "token").write_text("token-1\n")
    (directory / "ca.crt").write_bytes(ca.cert.read_bytes())
    (directory / "namespace").write_text(NAMESPACE)
    api_pair = ca.issue("apiserver", dns=["kubernetes.default.svc"], ips=["127.0.0.1"])
    (directory / "apiserver.crt").write_bytes(api_pair.cert.read_bytes())
    (directory / "apiserver.key").write_bytes(api_pair.key.read_bytes())
    return directory


@pytest.fixture
def api(account):
    server = FakeApiServer(KeyPair(account / "apiserver.crt", account / "apiserver.key"), account / "token")
    yield server
    server.close()


@pytest.fixture
def in_cluster(monkeypatch, account, api) -> ApiServer:
    """This process as a pod: the KUBERNETES_SERVICE_* variables and the service account mount."""
    host, port = urllib.parse.urlsplit(api.url).netloc.split(":")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", host)
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", port)
    monkeypatch.setattr(endpoint_slices, "SERVICE_ACCOUNT_DIR", account)
    return ApiServer.in_cluster()


def lookup(api_server: ApiServer, name: str) -> set[str]:
    return asyncio.run(EndpointSlices(api_server).ready_ips(name))


# ------------------------------------------------------------------------- the lookup

def test_in_cluster_finds_the_api_server_and_the_pods_service_account(in_cluster, api, account):
    assert in_cluster == ApiServer(api.url, str(account / "ca.crt"), str(account / "token"), NAMESPACE)


def test_ready_endpoints_of_every_slice_of_the_service_are_workers(in_cluster, api):
    api.slices = [
        endpoint_slice("workers", "IPv4", {"10.0.0.1": {"ready": True}, "10.0.0.2": {},
                                           "10.0.0.3": {"ready": False}}, name="workers-a"),
        # A terminating pod (draining) is not ready, though it still serves its requests.
        endpoint_slice("workers", "IPv4", {"10.0.0.4": {"ready": True},
                                           "10.0.0.5": {"ready": False, "serving": True, "terminating": True}},
                       name="workers-b"),
        endpoint_slice("others", "IPv4", {"10.0.9.9": {"ready": True}}),
    ]
    assert lookup(in_cluster, f"workers.{NAMESPACE}") == {"10.0.0.1", "10.0.0.2", "10.0.0.4"}
    assert api.requests[-1][:2] == (LIST_PATH.format(NAMESPACE), "kubernetes.io/service-name=workers")


def test_a_service_named_without_a_namespace_is_in_the_pods_own(in_cluster, api):
    api.slices = [endpoint_slice("workers", "IPv4", {"10.0.0.1": {"ready": True}})]
    assert lookup(in_cluster, "workers") == {"10.0.0.1"}
    assert api.requests[-1][0] == LIST_PATH.format(NAMESPACE)


def test_dual_stack_counts_each_pod_once_by_its_ipv4_address(in_cluster, api):
    api.slices = [endpoint_slice("workers", "IPv6", {"fd00::1": {"ready": True}}),
                  endpoint_slice("workers", "IPv4", {"10.0.0.1": {"ready": True}})]
    assert lookup(in_cluster, "workers") == {"10.0.0.1"}
    api.slices = api.slices[:1]
    assert lookup(in_cluster, "workers") == {"fd00::1"}


def test_each_request_carries_the_token_as_the_kubelet_last_wrote_it(in_cluster, api, account):
    lookup(in_cluster, "workers")
    (account / "token").write_text("token-2\n")     # a rotated bound token
    lookup(in_cluster, "workers")
    assert [token for *_, token in api.requests] == ["token-1", "token-2"]


def test_an_error_of_the_api_is_an_os_error_with_its_message(in_cluster, api):
    api.refuse = (403, 'endpointslices.discovery.k8s.io is forbidden: User "system:serviceaccount:'
                       'serving:default" cannot list resource "endpointslices"')
    with pytest.raises(OSError, match=r"serving/workers failed: HTTP 403: endpointslices.* is forbidden"):
        lookup(in_cluster, "workers")


def test_an_api_server_whose_certificate_another_ca_signed_is_refused(in_cluster, tmp_path):
    stranger = make_ca(tmp_path / "stranger").issue("stranger", ips=["127.0.0.1"])
    impostor = FakeApiServer(stranger, Path(in_cluster.token_file))
    try:
        with pytest.raises(OSError, match="CERTIFICATE_VERIFY_FAILED"):
            lookup(ApiServer(impostor.url, in_cluster.ca_file, in_cluster.token_file, NAMESPACE), "workers")
    finally:
        impostor.close()
    assert not impostor.requests     # the token never went out


def test_outside_a_pod_k8s_targets_are_refused_at_once(monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(ValueError, match="KUBERNETES_SERVICE_HOST is not set"):
        Discovery(["k8s:workers:50061"], lambda added, removed: None)


def test_without_a_service_account_k8s_targets_are_refused_at_once(monkeypatch, tmp_path):
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setattr(endpoint_slices, "SERVICE_ACCOUNT_DIR", tmp_path / "absent")
    with pytest.raises(ValueError, match="need the pod's service account .*automountServiceAccountToken"):
        Discovery(["k8s:workers:50061"], lambda added, removed: None)


# ------------------------------------------------------------------------- discovery

def test_discovery_follows_the_services_ready_endpoints(in_cluster, api):
    async def scenario() -> list:
        changes = []
        discovery = Discovery([f"k8s:workers.{NAMESPACE}:50061"], lambda *change: changes.append(change),
                              resolvers={"k8s": kubernetes_resolver(EndpointSlices(in_cluster))})
        api.slices = [endpoint_slice("workers", "IPv4", {"10.0.0.1": {"ready": True}, "10.0.0.2": {"ready": True}})]
        await discovery.refresh()
        api.slices = [endpoint_slice("workers", "IPv4", {"10.0.0.1": {"ready": False}, "10.0.0.2": {"ready": True},
                                                         "10.0.0.3": {"ready": True}})]
        await discovery.refresh()
        return changes
    assert asyncio.run(scenario()) == [({"10.0.0.1:50061", "10.0.0.2:50061"}, set()),
                                       ({"10.0.0.3:50061"}, {"10.0.0.1:50061"})]


def test_a_refused_list_keeps_the_last_workers_and_logs_why(in_cluster, api, caplog):
    async def scenario() -> frozenset[str]:
        discovery = Discovery([f"k8s:workers.{NAMESPACE}:50061"], lambda *change: None,
                              resolvers={"k8s": kubernetes_resolver(EndpointSlices(in_cluster))})
        api.slices = [endpoint_slice("workers", "IPv4", {"10.0.0.1": {"ready": True}})]
        await discovery.refresh()
        api.refuse = (403, "endpointslices.discovery.k8s.io is forbidden")
        await discovery.refresh()
        return discovery.addresses
    with caplog.at_level(logging.WARNING, logger="router.discovery"):
        assert asyncio.run(scenario()) == {"10.0.0.1:50061"}
    assert "HTTP 403: endpointslices.discovery.k8s.io is forbidden" in caplog.text


@pytest.mark.slow
def test_a_router_in_a_pod_follows_a_worker_in_and_out_of_its_services_endpoints(in_cluster, api):
    """The router's own set-up (Discovery's default resolvers, from this "pod"): a worker that
    becomes ready is used; one that stops being ready is dropped within seconds."""
    with WorkerProcess(["--model", "default", "--device", "cpu", "--dtype", "float32"]) as worker:
        host, port = worker.address.split(":")

        async def scenario() -> float:
            router = Router(RouterConfig(workers=[f"k8s:workers:{port}"], host="127.0.0.1", port=0,
                                         discovery_refresh_s=0.2, fleet=FleetConfig(backoff_initial_s=0.2),
                                         shutdown_grace_s=1.0))
            await router.start()
            try:
                api.slices = [endpoint_slice("workers", "IPv4", {host: {"ready": True}})]
                await router.fleet.wait_for(lambda fleet: bool(fleet.accepting()), timeout_s=30)
                async with grpc.aio.insecure_channel(router.address) as channel:
                    request = pb.GenerateRequest(text="Hello", params=pb.SamplingParameters(max_tokens=4))
                    assert [r async for r in generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=60)]
                api.slices = [endpoint_slice("workers", "IPv4", {host: {"ready": False}})]
                unready = time.monotonic()
                await router.fleet.wait_for(lambda fleet: not fleet.workers, timeout_s=10)
                return time.monotonic() - unready
            finally:
                await router.stop()
        assert asyncio.run(scenario()) < 5
    assert {selector for _, selector, _ in api.requests} == {"kubernetes.io/service-name=workers"}

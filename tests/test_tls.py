"""TLS between routers and workers (common.tls), with certificates made here by openssl and a
real worker serving over mutual TLS on loopback: a router holding a certificate of the CA is
served; a plaintext client, a router without a certificate, a router that does not trust the
worker's CA and one expecting another name are refused; Kubernetes' probes get plaintext
health on a port of its own. Bad files stop start-up at once, with a message naming them."""

from __future__ import annotations

import asyncio
import subprocess
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from certificates import Ca, KeyPair, make_ca
from common.pb import generation_pb2 as pb
from common.pb import generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from common.tls import ClientTls, TlsError, load_client_tls, load_server_tls
from launcher import cli
from router.fleet import FleetConfig
from router.server import Router, RouterConfig
from router.worker_client import WorkerClient, WorkerUnavailable
from worker_process import REPO, WorkerProcess, free_port, module_command, python_path

# The name in the worker's certificate: routers dial an IP address, and check this name instead.
SERVER_NAME = "workers.tls.test"


@pytest.fixture(scope="module")
def ca(tmp_path_factory) -> Ca:
    return make_ca(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def router_pair(ca) -> KeyPair:
    return ca.issue("router")


@pytest.fixture(scope="module")
def router_tls(ca, router_pair) -> ClientTls:
    """What a router of the fleet dials workers with: the CA, and a certificate of its own."""
    return load_client_tls(str(ca.cert), str(router_pair.cert), str(router_pair.key), SERVER_NAME)


@pytest.fixture(scope="module")
def health_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def worker(ca, router_tls, health_port):
    """A worker serving over mutual TLS, with plaintext health on --health-port."""
    pair = ca.issue("worker", dns=[SERVER_NAME])
    with WorkerProcess(["--model", "default", "--device", "cpu", "--dtype", "float32",
                        "--tls-cert-file", str(pair.cert), "--tls-key-file", str(pair.key),
                        "--tls-client-ca-file", str(ca.cert), "--health-port", str(health_port)],
                       tls=router_tls) as process:
        yield process


def connect(worker: WorkerProcess, tls: ClientTls | None) -> None:
    """Opens the router's session to the worker (raises WorkerUnavailable), then closes it."""
    async def attempt() -> None:
        client = WorkerClient(worker.address, "test-router", tls=tls)
        try:
            await client.connect(timeout_s=10)
        finally:
            await client.close()
    asyncio.run(attempt())


# ------------------------------------------------------------------------- a worker over TLS

@pytest.mark.slow
def test_a_router_serves_through_a_worker_over_mutual_tls(worker, router_tls):
    async def scenario() -> str:
        router = Router(RouterConfig(workers=[worker.address], host="127.0.0.1", port=0,
                                     fleet=FleetConfig(worker_tls=router_tls), shutdown_grace_s=1.0))
        await router.start()
        try:
            await router.fleet.wait_for(lambda fleet: bool(fleet.accepting()), timeout_s=30)
            async with grpc.aio.insecure_channel(router.address) as channel:
                request = pb.GenerateRequest(text="The capital of France is", params=pb.SamplingParameters(
                    max_tokens=8, temperature=0, ignore_eos=True))
                replies = generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=60)
                return "".join([c.text async for r in replies for c in r.choices])
        finally:
            await router.stop()
    assert asyncio.run(scenario())


@pytest.mark.slow
def test_a_plaintext_client_is_refused(worker):
    with grpc.insecure_channel(worker.address) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            worker_pb2_grpc.WorkerStub(channel).Info(worker_pb2.InfoRequest(), timeout=10)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.slow
def test_a_router_without_a_client_certificate_is_refused(worker, ca):
    with pytest.raises(WorkerUnavailable):
        connect(worker, load_client_tls(str(ca.cert), server_name=SERVER_NAME))


@pytest.mark.slow
def test_a_router_refuses_a_worker_certificate_of_another_ca(worker, router_pair, tmp_path):
    other = make_ca(tmp_path, "other-ca")
    with pytest.raises(WorkerUnavailable, match="CERTIFICATE_VERIFY_FAILED"):
        connect(worker, load_client_tls(str(other.cert), str(router_pair.cert), str(router_pair.key),
                                        SERVER_NAME))


@pytest.mark.slow
def test_a_router_refuses_a_worker_certificate_for_another_name(worker, ca, router_pair):
    with pytest.raises(WorkerUnavailable, match="Hostname Verification"):
        connect(worker, load_client_tls(str(ca.cert), str(router_pair.cert), str(router_pair.key),
                                        "someone-else.test"))


@pytest.mark.slow
def test_the_health_port_serves_health_in_plaintext_and_nothing_else(worker, health_port):
    with grpc.insecure_channel(f"127.0.0.1:{health_port}") as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as info:
            worker_pb2_grpc.WorkerStub(channel).Info(worker_pb2.InfoRequest(), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


# ------------------------------------------------------------------------- files checked at start-up

@pytest.fixture(scope="module")
def files(ca, tmp_path_factory) -> dict[str, str]:
    """Good and bad PEM files by what they are."""
    directory = tmp_path_factory.mktemp("files")
    pair, other = ca.issue("good"), ca.issue("other")
    encrypted, garbled = directory / "encrypted.key", directory / "garbled.crt"
    subprocess.run(["openssl", "pkey", "-in", pair.key, "-aes256", "-passout", "pass:x", "-out", encrypted],
                   check=True)
    garbled.write_text("-----BEGIN CERTIFICATE-----\nnot base64 DER\n-----END CERTIFICATE-----\n")
    return {"cert": str(pair.cert), "key": str(pair.key), "other key": str(other.key),
            "encrypted key": str(encrypted), "garbled cert": str(garbled), "ca": str(ca.cert),
            "missing": str(directory / "missing.pem")}


@pytest.mark.parametrize("cert, key, message", [
    ("missing", "key", "cannot read the TLS certificate .*missing.pem: No such file or directory"),
    ("cert", "missing", "cannot read the TLS private key .*missing.pem"),
    ("key", "key", "the TLS certificate .*good.key holds no PEM certificate"),
    ("cert", "cert", "the TLS private key .*good.crt holds no PEM private key"),
    ("cert", "other key", "the TLS private key .*other.key is not the key of the certificate .*good.crt"),
    ("cert", "encrypted key", "the TLS private key .*encrypted.key is encrypted"),
    ("garbled cert", "key", "the TLS certificate .*garbled.crt or its key .*good.key is not valid PEM"),
])
def test_an_unusable_key_pair_is_refused_naming_the_file(files, cert, key, message):
    with pytest.raises(TlsError, match=message):
        load_server_tls(files[cert], files[key])


@pytest.mark.parametrize("ca_file, message", [
    ("missing", "cannot read the TLS CA certificates .*missing.pem"),
    ("key", "the TLS CA certificates .*good.key hold no PEM certificate"),
    ("garbled cert", "the TLS CA certificates .*garbled.crt are not valid PEM"),
])
def test_an_unusable_ca_file_is_refused_naming_it(files, ca_file, message):
    with pytest.raises(TlsError, match=message):
        load_client_tls(files[ca_file])


def test_a_client_certificate_without_its_key_is_refused(files):
    with pytest.raises(TlsError, match="needs its key"):
        load_client_tls(files["ca"], cert_file=files["cert"])


def test_a_worker_with_a_key_not_of_its_certificate_exits_at_once_naming_both(files):
    """Checked before torch is imported and the model loads: one line, exit code 2."""
    started = time.monotonic()
    result = subprocess.run(
        module_command("launcher.cli", "serve", "--role", "worker", "--worker-port", str(free_port()),
                       "--tls-cert-file", files["cert"], "--tls-key-file", files["other key"]),
        cwd=REPO, env={"PYTHONPATH": python_path(), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=60)
    assert result.returncode == cli.WORKER_REFUSED
    assert result.stderr.strip().splitlines()[-1] == (
        f"pagedserve: the TLS private key {files['other key']} is not the key of the certificate "
        f"{files['cert']}")
    assert "importing torch" not in result.stderr and time.monotonic() - started < 30


def test_a_router_with_an_unreadable_ca_file_exits_at_once_naming_it(files):
    result = subprocess.run(
        module_command("launcher.cli", "serve", "--role", "router", "--workers", "127.0.0.1:1",
                       "--port", str(free_port()), "--http-port", str(free_port()), "--metrics-port", "0",
                       "--worker-tls-ca-file", files["missing"]),
        cwd=REPO, env={"PYTHONPATH": python_path(), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        f"pagedserve: cannot read the TLS CA certificates {files['missing']}: No such file or directory")


@pytest.mark.parametrize("argv, message", [
    (["--role", "router", "--workers", "w:1", "--tls-cert-file", "c", "--tls-key-file", "k"],
     "--tls-cert-file, --tls-key-file: for --role worker only"),
    (["--role", "all", "--worker-tls-ca-file", "ca"], "--worker-tls-ca-file: for --role router only"),
    (["--role", "worker", "--tls-cert-file", "c"], "--tls-cert-file and --tls-key-file go together"),
    (["--role", "worker", "--tls-client-ca-file", "ca"], "--tls-client-ca-file needs --tls-cert-file"),
    (["--role", "router", "--workers", "w:1", "--worker-tls-cert-file", "c", "--worker-tls-key-file", "k"],
     "need --worker-tls-ca-file"),
    (["--role", "router", "--workers", "w:1", "--worker-tls-ca-file", "ca", "--worker-tls-key-file", "k"],
     "--worker-tls-cert-file and --worker-tls-key-file go together"),
])
def test_tls_flags_of_another_role_or_without_their_pair_are_refused(argv, message, capsys):
    parser = cli._serve_parser()
    with pytest.raises(SystemExit):
        cli._serve(parser.parse_args(argv), parser)
    assert message in capsys.readouterr().err

"""A client in another language, built only from protos/, against a real router and worker.

tests/node_client/client.js is what an outside user would write: @grpc/proto-loader reads the
.proto files at run time and @grpc/grpc-js makes the calls. Its dependencies are pinned by
tests/node_client/package-lock.json and installed with `npm ci` once per session; without node
or npm the module is skipped, but a failed install fails it (CI reaches the npm registry). One
worker (SmolLM2 on the CPU) and one in-process router serve the module; the Node client runs
once, printing every call's result as one JSON object, and is compared with the project's own
Python stubs making the same calls.
"""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from common.pb import generation_pb2 as pb
from router_harness import Stream, client, greedy_request, read_stream, running_router
from worker_process import REPO, WorkerProcess

NODE, NPM = shutil.which("node"), shutil.which("npm")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (NODE and NPM), reason="the Node.js client test needs `node` and `npm` on PATH"),
]

CLIENT_SOURCE = REPO / "tests" / "node_client"
PROTO_ROOT = REPO / "protos"
PROMPT = "The capital of France is"
MAX_TOKENS = 16
NPM_TIMEOUT_S = 300
NODE_TIMEOUT_S = 120

# A request the Python stubs serialize for the Node client to decode: explicit zeros and false
# in proto3 `optional` fields, a uint64 beyond JavaScript's exact integers, top_p left unset.
PYTHON_REQUEST = pb.GenerateRequest(
    text=PROMPT, skip_special_tokens=False,
    params=pb.SamplingParameters(temperature=0.0, logprobs=0, seed=2**63 - 1, max_tokens=MAX_TOKENS))


class NodeClientInstall:
    """`npm ci` of the client's locked dependencies into a temporary folder, started at once and
    waited for by ready(), so that it runs while the worker loads its model."""

    def __init__(self, directory: Path):
        self.directory = directory
        for name in ("package.json", "package-lock.json", "client.js"):
            shutil.copy(CLIENT_SOURCE / name, directory / name)
        # --ignore-scripts: nothing the client needs is built at install time (protobufjs's
        # postinstall only warns about how a dependent pins its version).
        self._npm = subprocess.Popen(
            [NPM, "ci", "--no-audit", "--no-fund", "--ignore-scripts", "--prefix", str(directory)],
            cwd=directory, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self._output: str | None = None

    def ready(self) -> Path:
        """The folder holding client.js and its node_modules; fails with npm's output if the
        install failed."""
        if self._output is None:
            try:
                self._output, _ = self._npm.communicate(timeout=NPM_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._npm.kill()
                self._output = self._npm.communicate()[0] + f"\n(killed after {NPM_TIMEOUT_S} s)"
        if self._npm.returncode != 0:
            pytest.fail(f"`npm ci` of tests/node_client failed (exit {self._npm.returncode}); CI reaches "
                        f"the npm registry, so this is a failure, not a skip:\n{self._output}", pytrace=False)
        return self.directory

    def close(self) -> None:
        """Stops an install still running (a session that ended before needing it)."""
        if self._npm.poll() is None:
            self._npm.kill()
            self._npm.communicate()


@pytest.fixture(scope="session")
def node_client_install(tmp_path_factory) -> NodeClientInstall:
    install = NodeClientInstall(tmp_path_factory.mktemp("node_client"))
    yield install
    install.close()


@pytest.fixture(scope="module")
def worker(node_client_install) -> WorkerProcess:
    """The module's worker, started after the install began so the two overlap."""
    process = WorkerProcess(["--worker-id", "node", "--model", "default", "--device", "cpu",
                             "--dtype", "float32", "--metrics-port", "0"],
                            env={"OMP_NUM_THREADS": "1"})
    process.start()
    yield process
    process.__exit__()


@dataclass
class Calls:
    """The same calls made by the Python stubs and by the Node client, against one router."""

    model_info: pb.ModelInfoResponse
    tokenize: pb.TokenizeResponse
    stream: Stream
    node: dict


@pytest.fixture(scope="module")
def calls(worker, node_client_install) -> Calls:
    directory = node_client_install.ready()
    worker.wait_ready()

    async def scenario() -> Calls:
        async with running_router(worker) as router, client(router) as stub:
            model_info = await stub.ModelInfo(pb.ModelInfoRequest(), timeout=30)
            tokenize = await stub.Tokenize(pb.TokenizeRequest(text=PROMPT), timeout=30)
            stream = await asyncio.wait_for(read_stream(stub.Generate(greedy_request(PROMPT, MAX_TOKENS))), 60)
            # The router serves from this event loop: the client must run beside it, not block it.
            node = await asyncio.create_subprocess_exec(
                NODE, "client.js", router.address, str(PROTO_ROOT), PROMPT,
                base64.b64encode(PYTHON_REQUEST.SerializeToString()).decode(),
                cwd=directory, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            try:
                stdout, stderr = await asyncio.wait_for(node.communicate(), NODE_TIMEOUT_S)
            except asyncio.TimeoutError:
                node.kill()
                await node.wait()
                raise AssertionError(f"the Node client did not finish within {NODE_TIMEOUT_S} s")
            assert node.returncode == 0, f"node client.js exited with {node.returncode}:\n{stderr.decode()}"
            return Calls(model_info, tokenize, stream, json.loads(stdout))
    return asyncio.run(scenario())


def _response(call: dict) -> dict:
    assert "error" not in call, call["error"]
    return call["response"]


def _usage(usage: pb.Usage) -> dict:
    return {name: getattr(usage, name) for name in ("prompt_tokens", "completion_tokens", "total_tokens")}


def test_node_client_sees_the_served_model(calls):
    info = _response(calls.node["model_info"])
    assert info["model_names"] == list(calls.model_info.model_names) and info["model_names"]
    assert (info["max_model_len"], info["vocab_size"]) == (calls.model_info.max_model_len,
                                                           calls.model_info.vocab_size)
    assert info["ready_workers"] == 1


def test_node_client_tokenizes_like_the_python_client(calls):
    tokens = _response(calls.node["tokenize"])
    assert tokens["token_ids"] == list(calls.tokenize.token_ids)
    assert tokens["count"] == calls.tokenize.count == len(calls.tokenize.token_ids)


def test_node_client_streams_the_same_greedy_completion_as_the_python_client(calls):
    generated = calls.node["generate"]
    assert "error" not in generated, generated["error"]
    assert generated["token_ids"] == calls.stream.token_ids
    assert generated["text"] == calls.stream.text
    assert len(generated["token_ids"]) == MAX_TOKENS and generated["text"]
    assert generated["finish_reason"] == pb.FinishReason.Name(calls.stream.finish_reason)
    assert set(generated["request_ids"]) == {"node-greedy"}
    # The stream's shape: admitted (prompt tokens only), tokens, final usage.
    first, last = calls.stream.responses[0].usage, calls.stream.responses[-1].usage
    assert generated["first_usage"] == _usage(first) and first.prompt_tokens == len(calls.tokenize.token_ids)
    assert generated["last_usage"] == _usage(last) and last.completion_tokens == MAX_TOKENS


def test_node_client_gets_invalid_argument_naming_the_bad_field(calls):
    invalid = calls.node["invalid"]
    assert invalid["token_ids"] == [] and invalid["finish_reason"] is None
    status = invalid["error"]
    assert (status["code"], status["code_name"]) == (3, "INVALID_ARGUMENT")
    assert "temperature" in status["details"], status["details"]


def test_node_client_reads_the_request_id_trailer_of_a_failed_generate(calls):
    request_id = calls.node["invalid"]["error"]["trailers"].get("request-id")
    assert isinstance(request_id, str) and len(request_id) == 32, calls.node["invalid"]["error"]


def test_proto_loader_sends_an_explicit_zero_temperature(calls):
    """Unset temperature means 1.0: a greedy request only stays greedy if 0 is on the wire."""
    sent = pb.GenerateRequest.FromString(base64.b64decode(calls.node["greedy_request_base64"]))
    assert sent.WhichOneof("input") == "text" and sent.text == PROMPT
    assert sent.params.HasField("temperature") and sent.params.temperature == 0.0
    assert sent.params.max_tokens == MAX_TOKENS
    assert not sent.params.HasField("top_p") and not sent.HasField("skip_special_tokens")


def test_proto_loader_shows_which_optional_fields_are_set(calls):
    """proto3 `optional` fields arrive in JavaScript with their presence: an explicit zero or
    false is there (with its synthetic oneof `_name` naming it), an unset one is absent."""
    decoded = calls.node["python_request"]
    params = decoded["params"]
    assert decoded["input"] == "text" and decoded["text"] == PROMPT
    assert (params["temperature"], params["_temperature"]) == (0, "temperature")
    assert (params["logprobs"], params["_logprobs"]) == (0, "logprobs")
    assert (decoded["skip_special_tokens"], decoded["_skip_special_tokens"]) == (False, "skip_special_tokens")
    assert params["seed"] == str(2**63 - 1)     # longs: String keeps a uint64 exact
    assert "top_p" not in params and "n" not in params and "_top_p" not in params

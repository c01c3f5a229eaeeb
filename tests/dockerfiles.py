"""What the images' Dockerfiles (docker/) install, read from the files themselves, so that the
tests install the same sources and extras."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOCKER = REPO / "docker"


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of each instruction, continuation lines joined, comments left out."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    result = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            result.append((word.upper(), rest.strip()))
    return result


def copied_sources(dockerfile: Path) -> list[str]:
    """The repository paths the image COPYs in."""
    sources = []
    for word, arguments in instructions(dockerfile):
        if word == "COPY":
            sources += arguments.split()[:-1]
    return sources


def installed_extras(dockerfile: Path) -> set[str]:
    """The extras of the image's `pip install <the copied source>[extras]`."""
    extras: set[str] = set()
    for word, arguments in instructions(dockerfile):
        if word == "RUN":
            for match in re.finditer(r"pip install [^&]*?/opt/pagedserve\[([\w,]+)\]", arguments):
                extras |= set(match.group(1).split(","))
    return extras

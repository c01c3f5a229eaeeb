"""Certificates for the TLS tests, made by the openssl command: a CA, and certificates it signs
for names and addresses (valid for a day, EC P-256 keys, for server and client use alike).

    ca = make_ca(tmp_path)
    worker = ca.issue("worker", dns=["workers.test"])     # worker.cert, worker.key
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

_KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


@dataclass(frozen=True)
class KeyPair:
    """A certificate and its private key, PEM files."""

    cert: Path
    key: Path


@dataclass(frozen=True)
class Ca(KeyPair):
    """A self-signed CA that signs certificates into its directory."""

    def issue(self, name: str, dns: Sequence[str] = (), ips: Sequence[str] = ()) -> KeyPair:
        """A certificate for `name` (its file names too) with these subject alternative names."""
        directory = self.cert.parent
        pair = KeyPair(directory / f"{name}.crt", directory / f"{name}.key")
        request, extensions = directory / f"{name}.csr", directory / f"{name}.ext"
        names = [f"DNS:{d}" for d in dns] + [f"IP:{ip}" for ip in ips]
        extensions.write_text((f"subjectAltName={','.join(names)}\n" if names else "")
                              + "extendedKeyUsage=serverAuth,clientAuth\n")
        _openssl("req", *_KEY, "-keyout", pair.key, "-out", request, "-subj", f"/CN={name}")
        _openssl("x509", "-req", "-in", request, "-CA", self.cert, "-CAkey", self.key,
                 "-CAcreateserial", "-days", "1", "-out", pair.cert, "-extfile", extensions)
        return pair


def make_ca(directory: Path, name: str = "ca") -> Ca:
    """A new CA whose files are directory/<name>.crt and .key; skips the test without openssl."""
    if shutil.which("openssl") is None:
        pytest.skip("making test certificates needs the openssl command")
    directory.mkdir(parents=True, exist_ok=True)
    ca = Ca(directory / f"{name}.crt", directory / f"{name}.key")
    _openssl("req", "-x509", *_KEY, "-keyout", ca.key, "-out", ca.cert, "-days", "1",
             "-subj", f"/CN=pagedserve test {name}")
    return ca


def _openssl(*args: str | Path) -> None:
    result = subprocess.run(["openssl", *map(str, args)], capture_output=True, text=True)
    assert result.returncode == 0, f"openssl {' '.join(map(str, args))}: {result.stderr}"

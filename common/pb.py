"""The Python code generated from protos/, built on demand so a fresh clone needs no build step.

    from common.pb import generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc

Importing this module runs grpc_tools' protoc into common/generated/ (gitignored) when that code
is missing or was made from other .proto files or another protoc. `python -m common.pb` does
the same explicitly, for example while building a container image with a read-only root; where
grpcio-tools is not installed (such an image at run time), the code already generated is used.
"""

from __future__ import annotations

import errno
import hashlib
import importlib.resources
import shutil
import sys
import tempfile
from pathlib import Path

try:
    from grpc_tools import grpc_version, protoc
except ImportError:
    grpc_version = protoc = None

PROTO_ROOT = Path(__file__).resolve().parent.parent / "protos"
GENERATED = Path(__file__).resolve().parent / "generated"

# The generated code's top-level package, mirroring protos/pagedserve/. It is replaced as a whole.
_PACKAGE = "pagedserve"
_FINGERPRINT = "FINGERPRINT"


def fingerprint(proto_root: Path = PROTO_ROOT) -> str:
    """A digest of every .proto under proto_root and of the generator's version.

    Content rather than modification times decides staleness: checkouts, copies and clock skew
    change mtimes, but only a change of content changes the code.
    """
    digest = hashlib.sha256(f"grpcio-tools {grpc_version.VERSION}\0".encode())
    for path in sorted(proto_root.rglob("*.proto")):
        digest.update(path.relative_to(proto_root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def ensure_generated(proto_root: Path = PROTO_ROOT, out_dir: Path = GENERATED) -> Path:
    """Makes out_dir/pagedserve hold code generated from proto_root; returns out_dir.

    Safe when several processes do it at once: each compiles into its own staging folder inside
    out_dir and renames the result into place, so nobody sees a half-written tree, and a current
    tree is never replaced (only a stale one is, which running processes have not imported).
    """
    target = out_dir / _PACKAGE
    if protoc is None:
        if _fingerprint_of(target) is None:
            raise RuntimeError(f"no generated code in {target}, and grpcio-tools, which makes it "
                               "from protos/, is not installed: pip install grpcio-tools")
        return out_dir
    wanted = fingerprint(proto_root)
    if _fingerprint_of(target) == wanted:
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=out_dir))
    try:
        _compile(proto_root, staging)
        built = staging / _PACKAGE
        for package_dir in [built, *(p for p in built.rglob("*") if p.is_dir())]:
            (package_dir / "__init__.py").touch()
        (built / _FINGERPRINT).write_text(wanted)
        _install(built, target, wanted, trash=staging)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def _compile(proto_root: Path, out: Path) -> None:
    sources = sorted(p.relative_to(proto_root).as_posix() for p in proto_root.rglob("*.proto"))
    well_known_types = importlib.resources.files("grpc_tools") / "_proto"
    status = protoc.main([
        "protoc", f"--proto_path={proto_root}", f"--proto_path={well_known_types}",
        f"--python_out={out}", f"--pyi_out={out}", f"--grpc_python_out={out}", *sources,
    ])
    if status != 0:
        raise RuntimeError(f"protoc failed on the .proto files in {proto_root} "
                           "(its errors are printed above)")


def _install(new: Path, target: Path, wanted: str, trash: Path) -> None:
    """Renames new to target unless another process installed the same code first; a stale
    target is moved into trash first (both renames are atomic)."""
    for attempt in range(100):
        try:
            new.rename(target)
            return
        except OSError as error:
            if error.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
        if _fingerprint_of(target) == wanted:
            return
        try:
            target.rename(trash / f"replaced-{attempt}")
        except FileNotFoundError:
            pass  # another process moved it first
    raise RuntimeError(f"could not install generated code at {target}: it keeps changing")


def _fingerprint_of(generated_package: Path) -> str | None:
    try:
        return (generated_package / _FINGERPRINT).read_text()
    except OSError:
        return None


ensure_generated()
if str(GENERATED) not in sys.path:
    sys.path.append(str(GENERATED))

from pagedserve.v1 import generation_pb2, generation_pb2_grpc  # noqa: E402
from pagedserve.worker.v1 import worker_pb2, worker_pb2_grpc  # noqa: E402

__all__ = ["generation_pb2", "generation_pb2_grpc", "worker_pb2", "worker_pb2_grpc",
           "ensure_generated", "fingerprint"]

if __name__ == "__main__":
    print(f"code generated from {PROTO_ROOT} is in {GENERATED / _PACKAGE}")

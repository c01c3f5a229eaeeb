"""Programmatic dependent launch (PDL) of the decode step's Triton kernels on Hopper and later.

A batch-1 decode step of an 8B model is about 300 kernels, most of them a few microseconds
long, and between each two the GPU idled about a microsecond while the next grid launched. A
kernel launched with PDL starts while its predecessor still runs: its launch and the set-up of
its programs overlap the predecessor's last programs, and then it waits for the predecessor.
Measured (8B bf16, one H200, same call): W2 221.5 tok/s without, 230.1 with; GPU idle per
step 0.56 -> 0.30 ms (docs/BENCHMARKS.md, 2026-12-04).
Prefetching a GEMV's weight into L2 before the wait made it slower (228.1 with 1 KB a row,
211.7 with 4 KB: the prefetches compete with the predecessor's and the GEMV's own loads).

The rule every kernel launched with `launch_options(pdl_enabled(device))` follows: it calls
`wait_for_predecessor(PDL)` before its first read of anything an earlier kernel wrote and
before its first write (the predecessor may still be reading the buffer the allocator gave
this kernel's output). The wait returns once the predecessor has finished and its writes
are visible; since that predecessor, if launched the same way, waited for its own, the
chain is ordered as without PDL. Right after the wait each kernel lets its successor launch
(`griddepcontrol.launch_dependents`); a successor launched without PDL (a torch or cuBLAS
kernel) waits for this one to finish as usual.

`PAGEDSERVE_PDL=0` turns it off (a kill switch: every launch then waits as before).
"""

import functools
import os

import torch
import triton
import triton.language as tl

try:    # a Triton without grid dependency control runs everything without PDL
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    _AVAILABLE = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    _AVAILABLE = False


@functools.cache
def _device_supports(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def pdl_enabled(device: torch.device) -> bool:
    """Whether the decode kernels on `device` launch with PDL: CUDA on compute capability 9.0+
    (where `griddepcontrol` exists), a Triton that has it, not the interpreter, and not turned
    off by `PAGEDSERVE_PDL=0`. Read per launch, so a test can turn it off in one process."""
    if device.type != "cuda" or not _AVAILABLE or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if os.environ.get("PAGEDSERVE_PDL", "1") == "0":
        return False
    return _device_supports(device.index if device.index is not None else torch.cuda.current_device())


@triton.jit
def wait_for_predecessor(PDL: tl.constexpr):
    """Waits until the kernel before this one has finished and its writes are visible, then
    lets the next kernel launch. A no-op without PDL."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


def launch_options(pdl: bool) -> dict:
    """The launch keyword that asks Triton for PDL; none without it (a Triton older than PDL
    knows no such option)."""
    return {"launch_pdl": True} if pdl else {}

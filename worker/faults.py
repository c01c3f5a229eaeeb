"""Engine faults: which step failures mean the device is gone, and the hook that injects faults.

A step that raises leaves the engine's state (blocks, pending tokens) half-updated, and a CUDA
error of the kind an illegal memory access gives leaves the device context unusable: every
later call fails the same way. So a failed step is never retried. The worker hands its
requests back to the routers and exits (`EXIT_CODE`), for its supervisor to restart it.
Request errors never reach the step: they are refused at submission (`InvalidRequest`).

`PAGEDSERVE_INJECT_FAULT` makes the worker misbehave on purpose, for tests of that path:
`device@N` raises a CUDA-classified error in the N-th step, `stall@N:SECONDS` blocks the N-th
step for that long (the watchdog's case).
"""

import os
import time
from dataclasses import dataclass

import torch

EXIT_CODE = 3               # the worker's exit status after an engine fault
INJECT_ENV = "PAGEDSERVE_INJECT_FAULT"

# What torch, cuBLAS, Triton and NCCL put in the messages of errors that come from the device
# (torch < 2.8 raises them as plain RuntimeErrors; later ones as torch.AcceleratorError).
_DEVICE_MARKERS = ("CUDA error", "CUDA driver error", "CUBLAS_STATUS", "CUDNN_STATUS",
                   "Triton Error [CUDA]", "illegal memory access", "device-side assert",
                   "unspecified launch failure", "NCCL error")


def is_device_fault(error: BaseException) -> bool:
    """Whether a step failed because of the device (as opposed to a bug of the engine)."""
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(error, accelerator_error):
        return True
    return isinstance(error, RuntimeError) and any(m in str(error) for m in _DEVICE_MARKERS)


class InjectedDeviceFault(RuntimeError):
    """Raised by the `device@N` hook; its message reads as the CUDA error it stands for."""


@dataclass(frozen=True)
class FaultInjection:
    """A fault to inject at one step (see the module docstring)."""

    kind: str               # "device" or "stall"
    step: int
    seconds: float = 0.0

    @classmethod
    def from_env(cls) -> "FaultInjection | None":
        spec = os.environ.get(INJECT_ENV)
        return cls.parse(spec) if spec else None

    @classmethod
    def parse(cls, spec: str) -> "FaultInjection":
        kind, _, at = spec.partition("@")
        step, _, seconds = at.partition(":")
        try:
            if kind == "device" and not seconds:
                return cls(kind, int(step))
            if kind == "stall":
                return cls(kind, int(step), float(seconds))
        except ValueError:
            pass
        raise ValueError(f"{INJECT_ENV}={spec!r} is invalid: use device@STEP or stall@STEP:SECONDS")

    def before_step(self, step: int) -> None:
        """Called before the engine's `step`-th step."""
        if step != self.step:
            return
        if self.kind == "stall":
            time.sleep(self.seconds)
        else:
            raise InjectedDeviceFault(f"CUDA error: an illegal memory access was encountered "
                                      f"(injected by {INJECT_ENV} at step {step})")

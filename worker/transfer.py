"""Host-to-device copies of small per-step arrays that do not make the host wait for the GPU."""

import torch


def to_device(data, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`torch.as_tensor(data, dtype=dtype, device=device)`, minus the wait. A copy from pageable
    host memory synchronizes with the GPU, so the host would stall until the step in flight
    ends; a copy from pinned memory is queued behind it instead (PyTorch's caching host
    allocator keeps the pinned buffer alive until the copy has run)."""
    if device.type != "cuda":
        return torch.as_tensor(data, dtype=dtype, device=device)     # a tensor as it is, not copied
    return torch.as_tensor(data, dtype=dtype).pin_memory().to(device, non_blocking=True)

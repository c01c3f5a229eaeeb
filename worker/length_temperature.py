"""The example logits processor: a temperature that grows with the input's length.

A request that selects `length_temperature` samples at temperature × (1 + prompt tokens /
scale), scale 1000 unless its extra_args give `length_scale` (a positive number): a long prompt
gets more varied continuations. Dividing the logits by that factor before the sampler divides
them by the temperature is the same as sampling at the product; greedy requests stay greedy.

    pagedserve serve --logits-processors length_temperature
    curl localhost:8000/v1/completions -d '{"prompt": "...", "temperature": 0.7,
        "logits_processors": ["length_temperature"], "vllm_xargs": {"length_scale": 500}}'
"""

from __future__ import annotations

from typing import Any

import torch

from worker.logits_processors import LogitsProcessor, ProcessorBatch
from worker.transfer import to_device

DEFAULT_SCALE = 1000.0


class LengthTemperature(LogitsProcessor):
    name = "length_temperature"

    def validate(self, extra_args: dict[str, Any]) -> None:
        scale = extra_args.get("length_scale", DEFAULT_SCALE)
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
            raise ValueError(f"length_scale={scale!r} must be a positive number")

    def apply(self, logits: torch.Tensor, batch: ProcessorBatch) -> torch.Tensor:
        scale = to_device([args.get("length_scale", DEFAULT_SCALE) for args in batch.extra_args],
                          torch.float32, logits.device)
        return logits / (1 + batch.prompt_lens / scale)[:, None]

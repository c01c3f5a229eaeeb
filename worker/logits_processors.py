"""Custom logits processors: plugins that edit the logits of the requests that ask for them,
batched on the device.

A worker loads processors at start (`--logits-processors SPEC ...`: each SPEC the name of an
entry point in the `pagedserve.logits_processors` group, or `module:Class`) and builds one
instance of each. A request selects them by their `name` (`SamplingParameters.logits_processors`,
HTTP `logits_processors`) and may pass them arguments (`SamplingParameters.extra_args`, HTTP
`vllm_xargs`); one naming a processor the worker did not load is refused. At every step each
processor is called once, with the logits rows of the requests that selected it:

    class Halve(LogitsProcessor):
        name = "halve"

        def apply(self, logits, batch):
            return logits / 2

`apply` runs in the sampler, after logit_bias, allowed_token_ids, the penalties, bad words,
min_tokens and grammar masks, and before temperature and top-k / top-p / min-p; processors run
in the order the worker loaded them, and the logprobs reported stay the model's own. It must
stay on the device and not wait for it (no `.item()` or `.tolist()` of a device tensor): the
step loop never waits for the GPU. An exception in `apply` is an engine fault (the worker hands
its requests back and exits), so check a request's arguments in `validate`, which runs when
the request arrives. `worker.length_temperature` is the example shipped with pagedserve.
"""

from __future__ import annotations

import abc
import importlib
import importlib.metadata
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

ENTRY_POINT_GROUP = "pagedserve.logits_processors"


@dataclass
class ProcessorBatch:
    """What a processor knows of the rows it gets, in their order."""
    prompt_lens: torch.Tensor       # [k] int64 on the device: prompt tokens of each row's request
    output_lens: torch.Tensor       # [k] int64 on the device: tokens generated before this one
    extra_args: list[dict[str, Any]]    # each row's request's extra_args (JSON values; numbers are floats)


class LogitsProcessor(abc.ABC):
    """A custom logits processor (see the module docstring). Subclasses set `name` and
    implement `apply`; the worker builds one instance at start."""

    name: ClassVar[str]             # what requests select it by

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size, self.device = vocab_size, device

    def validate(self, extra_args: dict[str, Any]) -> None:
        """Raises ValueError saying what is wrong with a request's extra_args, which refuses
        the request (INVALID_ARGUMENT); any arguments are fine by default."""

    @abc.abstractmethod
    def apply(self, logits: torch.Tensor, batch: ProcessorBatch) -> torch.Tensor:
        """The logits `[k, vocab]` (float32, on the device) of the k rows that selected this
        processor, edited in place or anew; returns them."""


def load_processors(specs: Sequence[str], vocab_size: int, device: torch.device) -> dict[str, LogitsProcessor]:
    """One instance of each processor `specs` name, by its `name`, in their order; raises
    ValueError naming a spec that does not load."""
    loaded: dict[str, LogitsProcessor] = {}
    for spec in specs:
        cls = _resolve(spec)
        if not (isinstance(cls, type) and issubclass(cls, LogitsProcessor)):
            raise ValueError(f"logits processor {spec!r} is not a subclass of {LogitsProcessor.__module__}."
                             f"{LogitsProcessor.__name__}")
        name = getattr(cls, "name", None)
        if not isinstance(name, str) or not name:
            raise ValueError(f"logits processor {spec!r} has no name: set the class attribute `name`")
        if name in loaded:
            raise ValueError(f"two logits processors are named {name!r}")
        loaded[name] = cls(vocab_size, device)
    return loaded


def _resolve(spec: str) -> object:
    """The class a spec names: `module:Class`, or an entry point's name."""
    if ":" in spec:
        module, _, attribute = spec.partition(":")
        try:
            return getattr(importlib.import_module(module), attribute)
        except (ImportError, AttributeError) as error:
            raise ValueError(f"logits processor {spec!r} does not load: {error}") from None
    found = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP, name=spec)
    if not found:
        known = sorted(ep.name for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))
        raise ValueError(f"logits processor {spec!r} is neither module:Class nor an entry point of "
                         f"{ENTRY_POINT_GROUP} (installed: {', '.join(known) or 'none'})")
    return next(iter(found)).load()

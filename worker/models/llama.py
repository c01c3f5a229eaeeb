"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2) over the paged KV pool.

The forward takes flat `(input_ids, positions)` of every sequence in the step; attention
reads its batch layout from `worker.context`. Weights arrive with Hugging Face names and are
packed on load: q/k/v into one projection, gate/up into another. Under tensor parallelism
(`worker.parallel`) each rank builds the same model with its slice of the heads, of the MLP
rows and of the vocabulary, and reads only that slice of each checkpoint tensor. The decoder's
linear layers come from a factory: `DenseLinear` (`nn.Linear` with a faster one-row path on a
GPU), or a quantized class of `worker.models.quantization`, whose parameters load here like
any other. A linear that quantizes its input per token itself (`quantizes_input`: FP8 W8A8)
gets it quantized by the kernel before it instead, the RMSNorm or the SiLU-and-mul
(`writes_quantized`).
"""

from collections.abc import Callable, Iterable
from typing import Protocol

import torch
from torch import nn

from kernels.activation import silu_and_mul
from kernels.attention import paged_attention
from kernels.linear import linear
from kernels.norm import fused_add_rms_norm, rms_norm
from kernels.rotary import apply_rotary_and_write_kv, build_cos_sin_cache
from worker.config import ModelConfig
from worker.context import get_context
from worker.parallel import Shard, all_reduce, gather_last_dim, split_heads

# Makes one decoder linear layer: (in_features, out_features, bias) -> module.
LinearFactory = Callable[[int, int, bool], nn.Module]


class DenseLinear(nn.Linear):
    """An unquantized decoder linear: `nn.Linear`'s parameters, `kernels.linear`'s product."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, quantize: bool = False):
        """`(normed, residual)`; `normed` quantized per token (`Fp8Activation`) with `quantize`."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps, quantize), x
        return fused_add_rms_norm(x, residual, self.weight, self.eps, quantize)


def writes_quantized(consumer: nn.Module, x: torch.Tensor) -> bool:
    """Whether the kernel making `consumer`'s input (of `x`'s rows, dtype and device) should
    write it quantized per token: `consumer` would quantize it so itself (its
    `quantizes_input`, which only `Fp8Linear` has), and one pass over the activations is saved."""
    quantizes_input = getattr(consumer, "quantizes_input", None)
    return quantizes_input is not None and quantizes_input(x)


class VocabEmbedding(nn.Module):
    """The embedding rows of this rank's slice of the vocabulary; the other rows' tokens get
    zeros here and their vectors from the all-reduce."""

    def __init__(self, cfg: ModelConfig, shard: Shard):
        super().__init__()
        self.shard = shard
        self.start, self.length, padded = shard.padded_split(cfg.vocab_size)
        self.weight = nn.Parameter(torch.empty(padded, cfg.hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.shard.size == 1:
            return nn.functional.embedding(input_ids, self.weight)
        local = input_ids - self.start
        here = (local >= 0) & (local < self.length)
        out = nn.functional.embedding(torch.where(here, local, 0), self.weight)
        return all_reduce(out * here[:, None].to(out.dtype), self.shard)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: Shard, linear: LinearFactory):
        super().__init__()
        self.shard = shard
        self.heads = split_heads(cfg.num_heads, cfg.num_kv_heads, shard)
        self.num_heads, self.num_kv_heads, self.head_dim = self.heads.num_heads, self.heads.num_kv_heads, cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.attention_bias)
        self.o_proj = linear(self.q_size, cfg.hidden_size, False)
        self.scale = self.head_dim ** -0.5
        # Views into the pool, bound by the model runner once the pool is allocated.
        self.k_cache = self.v_cache = torch.empty(0)
        # A float8 pool's scales for this rank's KV heads (kernels.cache): the checkpoint's
        # k_scale / v_scale where it has them (`kv_scales_loaded`), else ones.
        self.register_buffer("k_scale", torch.ones(self.num_kv_heads, dtype=torch.float32), persistent=False)
        self.register_buffer("v_scale", torch.ones(self.num_kv_heads, dtype=torch.float32), persistent=False)
        self.kv_scales_loaded = False

    def load_kv_scale(self, name: str, which: str, tensor: torch.Tensor, total_kv_heads: int) -> None:
        """Sets K's, V's or both scales (`which`: k, v, kv) from checkpoint tensor `name`: one
        value for the layer, or one per KV head of the whole model (this rank takes its own)."""
        values = tensor.float().reshape(-1)
        if values.numel() == total_kv_heads:
            values = values[self.heads.kv_start:self.heads.kv_start + self.num_kv_heads]
        elif values.numel() != 1:
            raise ValueError(f"checkpoint tensor {name!r} has {values.numel()} values: a KV-cache scale is one "
                             f"per layer or one per KV head ({total_kv_heads})")
        if not bool(torch.isfinite(values).all() and (values > 0).all()):
            raise ValueError(f"checkpoint tensor {name!r} holds a KV-cache scale that is not a positive "
                             f"finite number: {values.tolist()[:4]}")
        for buffer in [self.k_scale] * ("k" in which) + [self.v_scale] * ("v" in which):
            buffer.copy_(values.expand(self.num_kv_heads))
        self.kv_scales_loaded = True

    def forward(self, positions: torch.Tensor, x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
        ctx = get_context()
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q = apply_rotary_and_write_kv(positions, q, k, v, cos_sin, self.k_cache, self.v_cache,
                                      ctx.slot_mapping, self.k_scale, self.v_scale)
        out = paged_attention(q, self.k_cache, self.v_cache, ctx.block_tables, ctx.seq_lens,
                              ctx.query_start_loc, ctx.max_query_len, ctx.max_seq_len, self.scale,
                              ctx.gather_plan, self.k_scale, self.v_scale)
        return all_reduce(self.o_proj(out.reshape(-1, self.q_size)), self.shard)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: Shard, linear: LinearFactory):
        super().__init__()
        self.shard = shard
        self.start, self.size = shard.split(cfg.intermediate_size)
        self.gate_up_proj = linear(cfg.hidden_size, 2 * self.size, False)
        self.down_proj = linear(self.size, cfg.hidden_size, False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        act = silu_and_mul(gate_up, quantize=writes_quantized(self.down_proj, gate_up))
        return all_reduce(self.down_proj(act), self.shard)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: Shard, linear: LinearFactory):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, shard, linear)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, shard, linear)

    def forward(self, positions, hidden, residual, cos_sin):
        hidden, residual = self.input_layernorm(
            hidden, residual, quantize=writes_quantized(self.self_attn.qkv_proj, hidden))
        hidden = self.self_attn(positions, hidden, cos_sin)
        hidden, residual = self.post_attention_layernorm(
            hidden, residual, quantize=writes_quantized(self.mlp.gate_up_proj, hidden))
        return self.mlp(hidden), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: Shard = Shard(), linear: LinearFactory = DenseLinear):
        super().__init__()
        self.config, self.shard = cfg, shard
        self.embed_tokens = VocabEmbedding(cfg, shard)
        self.layers = nn.ModuleList(DecoderLayer(cfg, shard, linear) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # The same vocabulary slice as the embedding, so a tied head shares its weight.
        self.lm_head = nn.Linear(cfg.hidden_size, self.embed_tokens.weight.shape[0], bias=False)
        self.register_buffer("cos_sin", torch.empty(cfg.max_position_embeddings, cfg.head_dim,
                                                    dtype=torch.float32), persistent=False)
        self.init_buffers()

    def init_buffers(self) -> None:
        """Ties the LM head and fills the rotary table; again after `to_empty` from meta."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        for layer in self.layers:
            layer.self_attn.k_scale.fill_(1.0)
            layer.self_attn.v_scale.fill_(1.0)
        if self.cos_sin.device.type != "meta":
            cfg = self.config
            self.cos_sin.copy_(build_cos_sin_cache(cfg.head_dim, cfg.max_position_embeddings,
                                                   cfg.rope_theta, cfg.rope_scaling))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states `[num_tokens, hidden]` of the flat batch."""
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, self.cos_sin)
        return self.norm(hidden, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Float logits `[rows, vocab]` on rank 0 (None on the other ranks)."""
        logits = gather_last_dim(self.lm_head(hidden), self.shard)
        return None if logits is None else logits[:, :self.config.vocab_size].float()

    def load_weights(self, weights: Iterable[tuple[str, "torch.Tensor | CheckpointSlice"]]) -> None:
        """Copies in this rank's slice of each Hugging Face-named tensor, packing q/k/v and
        gate/up. A tensor may come as a lazy checkpoint slice: then only the slice is read.

        Which dimension of a parameter runs along its layer's outputs and which along its
        inputs is the layer's to say (`checkpoint_axes`; `nn.Linear`'s `weight` is [out, in],
        its other parameters [out]): packed projections concatenate their parts along the
        outputs, column-parallel layers slice the outputs, row-parallel ones the inputs."""
        cfg, hd = self.config, self.config.head_dim
        heads, mlp, vocab = self.layers[0].self_attn.heads, self.layers[0].mlp, self.embed_tokens
        q, kv, inter = heads.num_heads * hd, heads.num_kv_heads * hd, mlp.size
        layout = {  # HF name piece -> (our piece, offset in its outputs, axis sliced, start, length, full size)
            "q_proj": ("qkv_proj", 0, OUT, heads.q_start * hd, q, cfg.num_heads * hd),
            "k_proj": ("qkv_proj", q, OUT, heads.kv_start * hd, kv, cfg.num_kv_heads * hd),
            "v_proj": ("qkv_proj", q + kv, OUT, heads.kv_start * hd, kv, cfg.num_kv_heads * hd),
            "o_proj": ("o_proj", 0, IN, heads.q_start * hd, q, cfg.num_heads * hd),
            "gate_proj": ("gate_up_proj", 0, OUT, mlp.start, inter, cfg.intermediate_size),
            "up_proj": ("gate_up_proj", inter, OUT, mlp.start, inter, cfg.intermediate_size),
            "down_proj": ("down_proj", 0, IN, mlp.start, inter, cfg.intermediate_size),
            "embed_tokens": ("embed_tokens", 0, OUT, vocab.start, vocab.length, cfg.vocab_size),
            "lm_head": ("lm_head", 0, OUT, vocab.start, vocab.length, cfg.vocab_size),
        }
        params, modules = dict(self.named_parameters()), dict(self.named_modules())
        loaded: dict[str, dict[int, str]] = {}   # our parameter -> output offsets filled, by whom
        for name, source in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name or (name == "lm_head.weight" and cfg.tie_word_embeddings):
                continue
            parts = name.split(".")
            if (kv_scale := _kv_scale(parts)) is not None:
                attention, which = kv_scale
                if attention not in modules:
                    raise ValueError(f"checkpoint tensor {name!r} has no place in {cfg.architecture}")
                tensor = source if isinstance(source, torch.Tensor) else source[...]   # 0-dim ones too
                modules[attention].load_kv_scale(name, which, tensor, cfg.num_kv_heads)
                continue
            shape = tuple(source.shape if isinstance(source, torch.Tensor) else source.get_shape())
            target, offset, tensor, out_dim = name, 0, None, None
            if len(parts) >= 2 and parts[-2] in layout:
                piece, offset, axis, start, length, full = layout[parts[-2]]
                owner = ".".join(parts[:-2] + [piece])
                target = f"{owner}.{parts[-1]}"
                out_dim, in_dim, per_entry = _axes(modules.get(owner), parts[-1])
                dim = out_dim if axis == OUT else in_dim
                if axis == IN and length == full:
                    dim = None      # every input on this rank: the tensor whole (a short last group too)
                if dim is not None:
                    if axis == IN:      # counted in entries of `per_entry` input features (packed, grouped)
                        if start % per_entry or length % per_entry:
                            raise ValueError(f"checkpoint tensor {name!r}: this rank's input features {start}.."
                                             f"{start + length - 1} are not whole entries of {per_entry}")
                        start, length, full = start // per_entry, length // per_entry, full // per_entry
                    if len(shape) <= dim or shape[dim] != full:
                        raise ValueError(f"checkpoint tensor {name!r} has shape {shape}: dimension {dim} "
                                         f"should be {full}")
                    tensor = _read(source, dim, start, length)
                if axis == IN:
                    out_dim = None      # one part, whole along the outputs
            if tensor is None:
                tensor = source if isinstance(source, torch.Tensor) else source[:]
            if target not in params:
                if parts[-1] == "bias" and target.removesuffix(".bias") in modules and not tensor.any():
                    continue    # a zero bias of a layer without one (AutoGPTQ writes one for every linear)
                raise ValueError(f"checkpoint tensor {name!r} has no place in {cfg.architecture}")
            dest = params[target].data
            if out_dim is not None:
                dest = dest.narrow(out_dim, offset, tensor.shape[out_dim])
            if dest.shape != tensor.shape:
                raise ValueError(f"checkpoint tensor {name!r} has shape {shape}, which does not fit "
                                 f"{target} of shape {tuple(params[target].shape)}")
            filled = loaded.setdefault(target, {})
            if out_dim is None and filled and not torch.equal(dest, tensor.to(dest.device, dest.dtype)):
                # One tensor for every part of a packed projection (an input order): they must agree.
                raise ValueError(f"checkpoint tensor {name!r} differs from {next(iter(filled.values()))!r}, "
                                 f"but {target} holds one for all the projections packed into it")
            dest.copy_(tensor)
            filled[offset] = name
        pieces = {"qkv_proj": 3, "gate_up_proj": 2}
        missing = [n for n in params if not (n == "lm_head.weight" and cfg.tie_word_embeddings)
                   and len(loaded.get(n, ())) < pieces.get(n.split(".")[-2], 1)]
        if missing:
            raise ValueError(f"checkpoint lacks tensors for {len(missing)} parameters, e.g. {missing[:3]}")


OUT, IN = "out", "in"   # a layer's axis that tensor parallelism slices: its outputs or its inputs

# Checkpoint names of KV-cache scales, by their last parts: compressed-tensors' and vLLM's
# (self_attn.k_scale), older compressed-tensors' (k_proj.output_scale), AutoFP8's one for both.
_KV_SCALE_NAMES = {("k_scale",): "k", ("v_scale",): "v", ("kv_scale",): "kv",
                   ("k_proj", "output_scale"): "k", ("v_proj", "output_scale"): "v"}


def _kv_scale(parts: list[str]) -> tuple[str, str] | None:
    """(the attention module's name, which scales) when `parts` name a KV-cache scale."""
    for tail, which in _KV_SCALE_NAMES.items():
        head = parts[:-len(tail)]
        if tuple(parts[-len(tail):]) == tail and head and head[-1] == "self_attn":
            return ".".join(head), which
    return None


def _axes(module: nn.Module | None, param: str) -> tuple[int | None, int | None, int]:
    """Parameter `param`'s dimension along `module`'s outputs, along its inputs (None: it has
    none), and the input features each entry along the latter stands for."""
    if hasattr(module, "checkpoint_axes"):
        return module.checkpoint_axes(param)
    return (0, 1, 1) if param == "weight" else (0, None, 1)


class CheckpointSlice(Protocol):
    """A tensor in a checkpoint, not read yet (what safetensors' `get_slice` returns):
    indexing it reads only the bytes asked for."""

    def get_shape(self) -> list[int]: ...
    def get_dtype(self) -> str: ...
    def __getitem__(self, index) -> torch.Tensor: ...


def _read(source: "torch.Tensor | CheckpointSlice", dim: int, start: int, length: int) -> torch.Tensor:
    """`length` entries of `source` along `dim` from `start`."""
    if isinstance(source, torch.Tensor):
        return source.narrow(dim, start, length)
    return source[(slice(None),) * dim + (slice(start, start + length),)]

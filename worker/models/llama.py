"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2) over the paged KV pool.

The forward takes flat `(input_ids, positions)` of every sequence in the step; attention
reads its batch layout from `worker.context`. Weights arrive with Hugging Face names and are
packed on load: q/k/v into one projection, gate/up into another.
"""

from collections.abc import Iterable

import torch
from torch import nn

from kernels.activation import silu_and_mul
from kernels.attention import paged_attention
from kernels.cache import write_kv
from kernels.norm import fused_add_rms_norm, rms_norm
from kernels.rotary import apply_rotary, build_cos_sin_cache
from worker.config import ModelConfig
from worker.context import get_context


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return rms_norm(x, self.weight, self.eps), x
        return fused_add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.scale = self.head_dim ** -0.5
        # Views into the pool, bound by the model runner once the pool is allocated.
        self.k_cache = self.v_cache = torch.empty(0)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
        ctx = get_context()
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(positions, q, k, cos_sin)
        write_kv(k, v, self.k_cache, self.v_cache, ctx.slot_mapping)
        out = paged_attention(q, self.k_cache, self.v_cache, ctx.block_tables, ctx.seq_lens,
                              ctx.query_start_loc, ctx.max_query_len, ctx.max_seq_len, self.scale,
                              ctx.gather_plan)
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, positions, hidden, residual, cos_sin):
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, cos_sin)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer("cos_sin", torch.empty(cfg.max_position_embeddings, cfg.head_dim,
                                                    dtype=torch.float32), persistent=False)
        self.init_buffers()

    def init_buffers(self) -> None:
        """Ties the LM head and fills the rotary table; again after `to_empty` from meta."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
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

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies Hugging Face-named tensors in, packing q/k/v and gate/up."""
        cfg = self.config
        q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
        packed = {  # HF name piece -> (our name piece, row offset, rows)
            "q_proj": ("qkv_proj", 0, q), "k_proj": ("qkv_proj", q, kv), "v_proj": ("qkv_proj", q + kv, kv),
            "gate_proj": ("gate_up_proj", 0, inter), "up_proj": ("gate_up_proj", inter, inter),
        }
        params = dict(self.named_parameters())
        loaded: dict[str, set[int]] = {}   # our parameter -> row offsets filled
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name or (name == "lm_head.weight" and cfg.tie_word_embeddings):
                continue
            parts = name.split(".")
            target, rows = name, None
            if len(parts) >= 2 and parts[-2] in packed:
                piece, offset, size = packed[parts[-2]]
                target = ".".join(parts[:-2] + [piece, parts[-1]])
                rows = (offset, size)
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {cfg.architecture}")
            dest = params[target].data if rows is None else params[target].data.narrow(0, *rows)
            if dest.shape != tensor.shape:
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(dest.shape)}")
            dest.copy_(tensor)
            loaded.setdefault(target, set()).add(0 if rows is None else rows[0])
        pieces = {"qkv_proj": 3, "gate_up_proj": 2}
        missing = [n for n in params if not (n == "lm_head.weight" and cfg.tie_word_embeddings)
                   and len(loaded.get(n, ())) < pieces.get(n.split(".")[-2], 1)]
        if missing:
            raise ValueError(f"checkpoint lacks tensors for {len(missing)} parameters, e.g. {missing[:3]}")

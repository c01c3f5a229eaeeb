"""Rotary position embedding (rotate-half / GPT-NeoX layout, as Hugging Face Llama uses).

The cos/sin table is built once per model: `cos_sin_cache[max_positions, rotary_dim]` holds
the cosines in its first half and the sines in its second. `apply_rotary_and_write_kv` is how
the model applies it: with the step's write of K/V into the paged pool.
"""

import math

import torch

from .cache import is_fp8, write_kv_ref


def rope_inv_freq(rotary_dim: int, base: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "llama3":
        factor = scaling["factor"]
        low_freq_factor = scaling["low_freq_factor"]
        high_freq_factor = scaling["high_freq_factor"]
        old_context = scaling["original_max_position_embeddings"]
        low_freq_wavelen = old_context / low_freq_factor
        high_freq_wavelen = old_context / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    elif rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif rope_type != "default":
        raise ValueError(f"unsupported rope scaling type {rope_type!r} (supported: default, linear, llama3)")
    return inv_freq.float()


def build_cos_sin_cache(rotary_dim: int, max_positions: int, base: float,
                        scaling: dict | None = None) -> torch.Tensor:
    inv_freq = rope_inv_freq(rotary_dim, base, scaling)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x32 = x.float()
    half = x32.shape[-1] // 2
    x1, x2 = x32[..., :half], x32[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def apply_rotary_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates `q[T, H, D]` and `k[T, KVH, D]` by the angles of `positions[T]`."""
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def apply_rotary_and_write_kv(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                              v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Attention's inputs of a step: rotates `q` and `k` by the angles of `positions`, stores
    the rotated keys and the values `v` at their slots of the pool (`kernels.cache`; a float8
    pool needs `k_scale`/`v_scale`) and returns the rotated queries. One kernel on a GPU."""
    if is_fp8(k_cache) and (k_scale is None or v_scale is None):
        raise ValueError("a float8 KV pool needs k_scale and v_scale")
    if q.is_cuda:
        from .triton_rotary import rotary_write_kv_triton
        return rotary_write_kv_triton(positions, q, k, v, cos_sin_cache, k_cache, v_cache,
                                      slot_mapping, k_scale, v_scale)
    q, k = apply_rotary_ref(positions, q, k, cos_sin_cache)
    write_kv_ref(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return q

"""Configuration records of the worker: the model's shape and the engine's limits."""

import math
import re
from dataclasses import dataclass, field, replace

# --quantization values: how the decoder's linear layers compute (vLLM's names). "none" keeps the
# weights as the checkpoint has them (a pre-quantized checkpoint stays quantized); "fp8" also
# quantizes a high-precision one on load, and "int8" the same in int8 (CPU only). "gptq", "awq" and "compressed-tensors" name a
# pre-quantized checkpoint's format: they run a checkpoint of that quant_method as stored (as
# "none" does) and refuse any other, since nothing here computes 4-bit weights from real ones.
# "gguf" keeps a GGUF file's decoder linears in their blocks on any device; "none" does so on a
# GPU only, and dequantizes them on load on the CPU, where that is faster.
QUANTIZATION_METHODS = ("none", "fp8", "int8", "gptq", "awq", "compressed-tensors", "gguf")
# --kv-cache-dtype values: "auto" stores K/V in the model's dtype; "fp8" (alias "fp8_e4m3") in
# float8 e4m3 with a scale per layer or per KV head, half the bytes of 16-bit K/V.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
# --max-num-batched-tokens when not given, by device type. On a GPU the budget bounds how long a
# new chat waits behind a step already running, and 4096 gave the best goodput of W5 (a chat
# mix with long documents) against 2048 and 8192 on an H100 and an H200 (docs/BENCHMARKS.md,
# 2026-12-04 and 2026-12-05); vLLM's API server takes 8192 on GPUs of 70 GB or more and 2048
# on smaller ones. On the CPU, where prompt tokens compute far more slowly and every running
# decode waits out the step, the smaller budget (not measured against 4096 there).
DEFAULT_STEP_TOKENS = {"cuda": 4096, "cpu": 2048}
# --long-prefill-token-threshold when not given, by device type (0: a prompt may take the whole
# budget). On the CPU a 6,000-token prompt in 2,048-token chunks stalled a running decode 12-15 s
# a step on a 2-core machine, and reached its first token later than in 512-token chunks (29.7-32.1
# s against 23.8-25.0: the attention of a long chunk over its context is the slow part there);
# docs/BENCHMARKS.md, 2026-12-07.
DEFAULT_LONG_PREFILL_TOKENS = {"cuda": 0, "cpu": 512}


@dataclass(frozen=True)
class CheckpointQuantization:
    """How a pre-quantized checkpoint stores its decoder linears (config.json's
    `quantization_config`, checked by `worker.models.quantization.checkpoint_quantization`)."""
    method: str                                  # what the linears compute: fp8 (W8A8) | w4a16 | w8a16
    quant_method: str                            # config.json's: compressed-tensors | fp8 | gptq | awq; or gguf
    weight_block_size: tuple[int, int] | None = None     # quant_method fp8: block scales
    # Integer weights (method w4a16, w8a16) only:
    group_size: int | None = None                # input features per scale; -1: one group per row
    act_order: bool = False                      # groups formed in activation order (g_idx stored)
    symmetric: bool = True                       # False: a zero point per group besides the scale
    checkpoint_format: str | None = None         # gptq: gptq (v1, zeros - 1) | gptq_v2; gguf: its kept types,
                                                 # "+"-joined (Q4_1, Q4_K+Q6_K, ...)
    # gguf: the model's decoder linears kept in their blocks (layers.<i>.mlp.down_proj, ...) -> GGUF type
    kept_modules: dict[str, str] | None = None


@dataclass
class ModelConfig:
    """Shape of a Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2)."""
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False          # Qwen2: bias on q/k/v projections
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    quantization: CheckpointQuantization | None = None   # None: high-precision weights

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token over all layers, for an element size of 1."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


@dataclass
class EngineConfig:
    model: str
    load_format: str = "auto"             # auto | hf | gguf | dummy
    dtype: str = "auto"
    quantization: str = "none"            # one of QUANTIZATION_METHODS
    kv_cache_dtype: str = "auto"          # one of KV_CACHE_DTYPES
    device: str = "auto"                  # auto | cpu | cuda
    seed: int = 0                         # for dummy weights
    block_size: int = 16
    max_num_seqs: int = 256
    # Token budget of one step; None: DEFAULT_STEP_TOKENS for the device (`for_device`).
    max_num_batched_tokens: int | None = None
    # Most prompt tokens one sequence computes in a step (0: up to the budget), vLLM's name: a
    # long document then leaves room for the decodes and short prompts beside it. None:
    # DEFAULT_LONG_PREFILL_TOKENS for the device.
    long_prefill_token_threshold: int | None = None
    max_model_len: int | None = None      # default: the model's, capped by the pool
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_gb: float = 1.0       # KV pool size on the CPU
    num_blocks: int | None = None         # overrides the sizing (tests, benchmarks)
    swap_space_gb: float = 1.0            # host swap pool for preempted requests
    num_swap_blocks: int | None = None    # overrides the swap sizing (tests)
    preemption_mode: str = "swap"         # swap (when the swap pool has room) | recompute
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"       # fcfs | priority
    enforce_eager: bool = False
    # Custom logits processors to load (worker.logits_processors): entry point names or module:Class.
    logits_processors: tuple[str, ...] = ()
    # Schedule and launch step N+1 before reading step N's tokens (see worker.engine). None:
    # on a GPU, where it hides the host's work behind the device's; off on the CPU, whose
    # forward runs in the launching thread, so it would only report each token a step later.
    async_scheduling: bool | None = None
    tensor_parallel_size: int = 1         # ranks (GPUs) one worker spreads the model over
    # The worker's watchdog: seconds an engine holding runnable work may go without a step
    # that advances it before the worker reports NOT_SERVING (0: no watchdog).
    stall_timeout_s: float = 60.0
    # Multi-LoRA (worker.lora): adapters in device slots, more in host memory.
    enable_lora: bool = False
    max_loras: int = 4                    # device slots: adapters one step can mix
    max_lora_rank: int = 16               # largest adapter rank accepted (slot width)
    max_cpu_loras: int = 32               # adapters held in host memory, least recently used dropped
    lora_modules: dict[str, str] = field(default_factory=dict)   # name -> PEFT directory, loaded at start

    def validate(self) -> "EngineConfig":
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device={self.device!r} is not supported: use auto, cpu, cuda or cuda:<index>")
        if self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization={self.quantization!r} is not supported: use one of "
                             f"{', '.join(QUANTIZATION_METHODS)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported: use one of "
                             f"{', '.join(KV_CACHE_DTYPES)}")
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size={self.block_size} must be one of 8, 16, 32, 64, 128")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} must be >= 1")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= 1")
        if self.long_prefill_token_threshold is not None and self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold={self.long_prefill_token_threshold} "
                             f"must be >= 0 (0: no limit)")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len={self.max_model_len} must be >= 1")
        if not (math.isfinite(self.kv_cache_memory_gb) and self.kv_cache_memory_gb > 0):
            raise ValueError(f"kv_cache_memory_gb={self.kv_cache_memory_gb} must be above 0")
        if not (math.isfinite(self.swap_space_gb) and self.swap_space_gb >= 0):
            raise ValueError(f"swap_space_gb={self.swap_space_gb} must be >= 0 (0: no swap space)")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy={self.scheduling_policy!r} must be fcfs or priority")
        if self.preemption_mode not in ("swap", "recompute"):
            raise ValueError(f"preemption_mode={self.preemption_mode!r} must be swap or recompute")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} must be >= 1")
        if not self.stall_timeout_s >= 0:       # NaN too
            raise ValueError(f"stall_timeout_s={self.stall_timeout_s} must be >= 0 (0: no watchdog)")
        if not 1 <= self.max_lora_rank <= 256:      # given without enable_lora too: a flag is checked
            raise ValueError(f"max_lora_rank={self.max_lora_rank} must be in [1, 256]")
        if self.enable_lora:
            if not 1 <= self.max_loras <= 64:
                raise ValueError(f"max_loras={self.max_loras} must be in [1, 64]")
            if self.max_cpu_loras < self.max_loras:
                raise ValueError(f"max_cpu_loras={self.max_cpu_loras} must be >= max_loras={self.max_loras}")
            if len(self.lora_modules) > self.max_cpu_loras:
                raise ValueError(f"{len(self.lora_modules)} lora_modules do not fit in max_cpu_loras="
                                 f"{self.max_cpu_loras}")
            if self.tensor_parallel_size > 1:
                raise ValueError("enable_lora with tensor_parallel_size > 1 is not supported yet: "
                                 "serve adapters on single-GPU workers")
        elif self.lora_modules:
            raise ValueError("lora_modules given without enable_lora")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks={self.num_blocks} must be >= 1")
        return self

    def for_device(self, device_type: str) -> "EngineConfig":
        """This config with the settings left to the device (None) chosen for `device_type`
        ("cuda" or "cpu"): the step's token budget, the prompt tokens of one sequence a step and
        asynchronous scheduling."""
        return replace(
            self,
            max_num_batched_tokens=(DEFAULT_STEP_TOKENS.get(device_type, DEFAULT_STEP_TOKENS["cpu"])
                                    if self.max_num_batched_tokens is None else self.max_num_batched_tokens),
            long_prefill_token_threshold=(
                DEFAULT_LONG_PREFILL_TOKENS.get(device_type, DEFAULT_LONG_PREFILL_TOKENS["cpu"])
                if self.long_prefill_token_threshold is None else self.long_prefill_token_threshold),
            async_scheduling=device_type == "cuda" if self.async_scheduling is None else self.async_scheduling)

"""The engine's command-line flags (vLLM's names where the meaning is the same) and the
EngineConfig they make. Imports no torch, so a router's `pagedserve serve --help` and
`--role router` start without it."""

import argparse
import json

from worker.config import KV_CACHE_DTYPES, QUANTIZATION_METHODS, EngineConfig

# The exit code of a worker that refused to start and said why (a taken port, a bad model or
# setting), as argparse's is for a bad flag: `serve --role all` then adds nothing to it.
WORKER_REFUSED = 2


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model, load_format=args.load_format, dtype=args.dtype,
        quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype, device=args.device,
        block_size=args.block_size, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        long_prefill_token_threshold=args.long_prefill_token_threshold, max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_memory_gb=args.kv_cache_memory_gb,
        num_blocks=args.num_blocks, swap_space_gb=args.swap_space, num_swap_blocks=args.num_swap_blocks,
        preemption_mode=args.preemption_mode, enable_prefix_caching=args.enable_prefix_caching,
        scheduling_policy=args.scheduling_policy, enforce_eager=args.enforce_eager,
        logits_processors=tuple(args.logits_processors or ()),
        async_scheduling=args.async_scheduling, tensor_parallel_size=args.tensor_parallel_size,
        stall_timeout_s=args.engine_stall_timeout, enable_lora=args.enable_lora or bool(args.lora_modules),
        max_loras=args.max_loras, max_lora_rank=args.max_lora_rank, max_cpu_loras=args.max_cpu_loras,
        lora_modules=dict(args.lora_modules or ()))


def lora_module(text: str) -> tuple[str, str]:
    """One --lora-modules entry: `name=path`, or vLLM's JSON `{"name": ..., "path": ...}`."""
    if text.lstrip().startswith("{"):
        try:
            entry = json.loads(text)
            return str(entry["name"]), str(entry["path"])
        except (ValueError, KeyError, TypeError):
            raise argparse.ArgumentTypeError(f"{text!r}: a JSON entry needs \"name\" and \"path\"") from None
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"{text!r}: expected name=path")
    return name, path


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags (vLLM names where the meaning is the same). The commands that use them make
    each readable from PAGEDSERVE_<FLAG> too (common.env_flags.apply_env)."""
    d = EngineConfig(model="default")
    a = parser.add_argument
    a("--model", default="default", help="Hugging Face directory, .gguf file, preset "
      "name with --load-format dummy, or 'default' (the embedded SmolLM2-135M-Instruct)")
    a("--load-format", default=d.load_format, choices=["auto", "hf", "gguf", "dummy"],
      help="how to read the weights; dummy = random weights of the model's shape")
    a("--dtype", default=d.dtype, help="auto (bfloat16 on GPU, float32 on CPU), float32, float16, bfloat16")
    a("--quantization", default=d.quantization, choices=QUANTIZATION_METHODS,
      help="fp8: W8A8 decoder linears (weights quantized per output channel on load, "
           "activations per token at run time; needs compute capability 8.9+, emulated on the "
           "CPU); int8: W8A8 int8 linears, quantized on load the same way (CPU only); none: the weights as stored (a pre-quantized FP8 or 4-bit checkpoint runs as "
           "stored; a GGUF file's Q4_0, Q4_1, Q4_K, Q6_K or Q8_0 linears stay in their blocks on a GPU "
           "and are dequantized on load on the CPU); gptq, awq, compressed-tensors: a checkpoint of that "
           "quant_method, as stored (W4A16 for 4-bit ones), any other refused; gguf: a GGUF file's "
           "linears in their blocks on any device")
    a("--kv-cache-dtype", default=d.kv_cache_dtype, choices=KV_CACHE_DTYPES,
      help="auto: K/V in the model's dtype; fp8 (or fp8_e4m3): float8 e4m3, twice the tokens in "
           "the same memory, with the checkpoint's k_scale/v_scale (per layer or per KV head) or "
           "1.0 where it has none; needs compute capability 8.9+ on a GPU")
    a("--device", default=d.device, help="auto (a GPU when there is one), cpu, cuda or cuda:<index>")
    a("--block-size", type=int, default=d.block_size, help="tokens per KV block")
    a("--max-num-seqs", type=int, default=d.max_num_seqs, help="sequences per step")
    a("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
      help="token budget of one step (prefill chunks + decodes); default 4096 on a GPU, 2048 "
           "on the CPU")
    a("--long-prefill-token-threshold", type=int, default=d.long_prefill_token_threshold,
      help="most prompt tokens one request computes in a step (0: up to the step's budget); "
           "default 0 on a GPU, 512 on the CPU")
    a("--max-model-len", type=int, default=None, help="context limit (default: the model's)")
    a("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
      help="share of GPU memory for weights, activations and the KV pool")
    a("--kv-cache-memory-gb", type=float, default=d.kv_cache_memory_gb, help="KV pool size on the CPU, in GiB")
    a("--num-blocks", type=int, default=None, help="KV pool size in blocks (overrides the sizing)")
    a("--swap-space", type=float, default=d.swap_space_gb, help="host swap space for preempted requests, in GiB")
    a("--num-swap-blocks", type=int, default=None, help="swap space in blocks (overrides)")
    a("--preemption-mode", default=d.preemption_mode, choices=["swap", "recompute"],
      help="swap: to host memory when there is room, else recompute")
    a("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=d.enable_prefix_caching,
      help="share KV blocks of equal prompt prefixes")
    a("--scheduling-policy", default=d.scheduling_policy, choices=["fcfs", "priority"],
      help="fcfs: decodes in arrival order; priority: by each request's priority, then arrival. "
           "Prompt chunks go shortest first within a priority (a prompt waiting over 2 s: by arrival)")
    a("--enforce-eager", action="store_true", default=d.enforce_eager, help="no CUDA graphs")
    a("--logits-processors", nargs="+", default=None, metavar="SPEC",
      help="custom logits processors requests may select by name: entry points of the "
           "pagedserve.logits_processors group (length_temperature ships with pagedserve) or "
           "module:Class (see worker/logits_processors.py)")
    a("--async-scheduling", action=argparse.BooleanOptionalAction, default=d.async_scheduling,
      help="launch each step before reading the previous one's tokens, so the GPU never waits "
           "for the host (stop tokens are seen one step late); default: on with a GPU, off on "
           "the CPU, where it would only delay each token by a step")
    a("--tensor-parallel-size", type=int, default=d.tensor_parallel_size,
      help="GPUs (ranks: processes) to split the model over; on the CPU, processes over gloo")
    a("--engine-stall-timeout", type=float, default=d.stall_timeout_s,
      help="the worker's watchdog: seconds its engine may hold runnable work without advancing "
           "it before the worker logs the engine's state and reports NOT_SERVING (0: off)")
    a("--enable-lora", action="store_true", default=d.enable_lora,
      help="serve LoRA adapters (PEFT format) beside the base model, chosen per request")
    a("--max-loras", type=int, default=d.max_loras, help="LoRA adapters one step can mix (device slots)")
    a("--max-lora-rank", type=int, default=d.max_lora_rank, help="largest LoRA rank accepted (up to 256)")
    a("--max-cpu-loras", type=int, default=d.max_cpu_loras,
      help="LoRA adapters held in host memory; beyond, the least recently used idle one is dropped")
    a("--lora-modules", nargs="+", type=lora_module, default=None, metavar="NAME=PATH",
      help="LoRA adapters to load at start (implies --enable-lora); also JSON {\"name\": ..., \"path\": ...}")

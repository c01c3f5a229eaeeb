"""Small helpers shared by the tests."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import torch

from common.sampling_params import SamplingParams
from worker.config import EngineConfig
from worker.engine import LLMEngine

LONG_STORY = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, counting each of the "
    "two hundred and twelve steps aloud. His grandfather had kept the same light, and his mother "
    "after that, and the logbook on the desk held their handwriting in faded inks of blue and "
    "brown. Ships passed less often now; most carried their own lights and maps that spoke. Still "
    "he polished the great lens, trimmed the wick of the old backup lamp, and wrote the weather "
    "in the book: wind from the north-west, sea moderate, visibility good. One night in October a "
    "small boat with no lights at all came around the point, rowing hard against the tide, and "
    "the keeper watched it through the telescope until it reached the shelter of the cove. ")

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "<|im_start|>user\nWhat is the boiling point of water?<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a small village by the sea,",
    "1, 2, 3, 4, 5,",
    "La vie est belle parce que",
    LONG_STORY[:400] + "What happened next?",     # several blocks
    LONG_STORY * 2 + "Summarize the story:",        # longer than the test step budget
]


def generate(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
             priorities: list[int] | None = None) -> dict[str, list[list[int]]]:
    """Submits every prompt at once and steps to the end: request id -> tokens of each choice."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    results: dict[str, list[list[int]]] = {}
    for i, (ids, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", ids, p, priority=(priorities or [0] * len(prompts))[i])
        results[f"r{i}"] = [[] for _ in range(p.n)]
    while engine.has_unfinished():
        for out in engine.step():
            results[out.request_id][out.index] += out.new_token_ids
    return results


def generate_with_a_swap(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams,
                         before: int = 3, held: int = 4) -> tuple[dict[str, list[int]], int]:
    """Runs prompts r0, r1, ... and swaps r0 out after `before` steps, holding it out for `held`
    steps before swapping it back in: the tokens of each, and r0's count while it was held."""
    got: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
        got[f"r{i}"] = []

    def step() -> None:
        for o in engine.step():
            got[o.request_id] += o.new_token_ids
    for _ in range(before):
        step()
    assert engine.preempt("r0", "swap", hold=True) == ["swap"]
    for _ in range(held):
        step()
    assert engine.stats().num_swapped == 1
    tokens_while_held = len(got["r0"])
    engine.swap_in("r0")
    while engine.has_unfinished():
        step()
    return got, tokens_while_held


def greedy(max_tokens: int = 24, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def tiny_hf_model(tmp_path, kind: str):
    """A small random Llama 3 / Qwen2 (biases, tied embeddings) / Mistral saved as a Hugging Face
    directory at tmp_path; returns the transformers model."""
    from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                              Qwen2ForCausalLM)
    common = dict(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    if kind == "llama3":
        config = LlamaConfig(**common, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})
        model = LlamaForCausalLM(config)
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=True))
    else:
        model = MistralForCausalLM(MistralConfig(**common, sliding_window=None))
    # Random (not zero) biases and norms, so a wrong packing or layout cannot hide.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(1.0 if "norm" in name else 0.0, 0.1)
    model.save_pretrained(tmp_path)
    return model.eval()


def tiny_llama(*, vocab_size: int = 512, hidden_size: int = 256, layers: int = 4,
               max_position_embeddings: int = 1024, num_heads: int | None = None):
    """A small random Llama (transformers) with grouped KV heads (2) and random norms, so a
    wrong layout cannot hide behind ones; `num_heads` defaults to 8 from hidden 128 up, else 4.
    Seeded: the same arguments give the same weights."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=layers, num_attention_heads=num_heads or (8 if hidden_size >= 128 else 4),
        num_key_value_heads=2, max_position_embeddings=max_position_embeddings))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
    return model.eval()


def save_tiny_llama(path, **shape):
    """`tiny_llama(**shape)` saved as a Hugging Face directory at `path`; returns the model."""
    model = tiny_llama(**shape)
    model.save_pretrained(path)
    return model


def overflowing_adapter(path, cfg) -> str:
    """A PEFT adapter of finite weights (so the reader takes it) whose delta overflows float32:
    its requests' hidden states become infinite at layer 0 and their logits NaN, as a broken
    fine-tune's would. One rank on layer 0's o_proj; base tokens never meet its B."""
    from safetensors.torch import save_file
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 1, "lora_alpha": 1,
                                                          "target_modules": ["o_proj"]}))
    prefix = "base_model.model.model.layers.0.self_attn.o_proj"
    save_file({f"{prefix}.lora_A.weight": torch.full((1, cfg.num_heads * cfg.head_dim), 1e10),
               f"{prefix}.lora_B.weight": torch.full((cfg.hidden_size, 1), 1e30)},
              str(path / "adapter_model.safetensors"))
    return str(path)


def save_byte_level_tokenizer(path, vocab_size: int = 512) -> None:
    """A byte-level BPE tokenizer trained on LONG_STORY, saved with its config at `path` beside
    a model of the same `vocab_size`: a Hugging Face directory with tokenizer files, where the
    embedded SmolLM2 GGUF cannot go (the GPU machine)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([LONG_STORY, *PROMPTS], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|end|>").save_pretrained(path)


def run_interpreter_tests(test_file: str) -> None:
    """Runs `test_file`'s interp_ tests in a subprocess with TRITON_INTERPRET=1 (which must be
    set before triton is first imported), so Triton kernels run on the CPU; fails with their
    output when any fails."""
    repo = Path(__file__).resolve().parent.parent
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(repo), str(repo / "tests"),
                                                        os.environ.get("PYTHONPATH")])))
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file, "-k", "interp_"],
        cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in result.stdout


def perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    """exp of the mean negative log-likelihood of each token of `ids` after the first, from the
    teacher-forced `logits` of every position."""
    return math.exp(torch.nn.functional.cross_entropy(logits[:-1].float(), torch.tensor(ids[1:])).item())


def engine_prompt_logits(path, ids: list[int], tensor_parallel_size: int = 1) -> torch.Tensor:
    """The float32 logits of every position of `ids` from an engine over the checkpoint at
    `path` on the CPU (teacher-forced)."""
    engine = LLMEngine(EngineConfig(model=str(path), device="cpu", dtype="float32", num_blocks=64,
                                    tensor_parallel_size=tensor_parallel_size))
    try:
        return engine.prompt_logits(ids)
    finally:
        engine.close()

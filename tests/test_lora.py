"""Multi-LoRA in the engine (worker.lora, worker.models.lora_checkpoint), against peft.

Adapters are made here with peft on transformers' SmolLM2 (random non-zero A and B), saved
with `save_pretrained`, and served by the engine beside the base model in one batch.
"""

import copy
import json

import pytest
import torch
from helpers import greedy

from common.sampling_params import InvalidRequest
from worker.engine import LoRANotFound
from worker.models.lora_checkpoint import LoRAAdapterError, read_lora_adapter

ADAPTERS = {  # name -> peft LoraConfig arguments
    "qv8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "all16": dict(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                       "gate_proj", "up_proj", "down_proj"]),
    "mlp_rs": dict(r=16, lora_alpha=8, use_rslora=True, target_modules=["gate_proj", "up_proj", "down_proj", "o_proj"]),
}
PROMPTS = ["The lighthouse keeper wrote in his log that", "def fibonacci(n):", "Paris is the capital of"]


def make_peft_model(hf_base, name: str, seed: int):
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(seed)
    # init_lora_weights=False: B random too, so the adapter changes the output from the start.
    model = get_peft_model(copy.deepcopy(hf_base), LoraConfig(init_lora_weights=False, **ADAPTERS[name]))
    with torch.no_grad():    # peft's random init is large for a 135M model: keep it a nudge
        for pname, p in model.named_parameters():
            if "lora_" in pname:
                p.mul_(0.3)
    return model.eval()


@pytest.fixture(scope="module")
def adapters(hf_smollm, tmp_path_factory):
    """name -> (path, peft model) for every adapter of ADAPTERS."""
    made = {}
    for seed, name in enumerate(ADAPTERS):
        path = tmp_path_factory.mktemp(name)
        model = make_peft_model(hf_smollm, name, seed)
        model.save_pretrained(path)
        made[name] = (str(path), model)
    return made


@pytest.fixture(scope="module")
def lora_engine(smollm_source, smollm_weights, adapters):
    from worker.config import EngineConfig
    from worker.engine import LLMEngine
    cfg, model = smollm_weights
    engine = LLMEngine(EngineConfig(model="default", device="cpu", dtype="float32", num_blocks=512,
                                    enable_lora=True, max_loras=4),
                       smollm_source, (cfg, copy.deepcopy(model)))
    for name, (path, _) in adapters.items():
        engine.add_lora(read_lora_adapter(name, path, cfg, 16))
    return engine


@pytest.fixture(scope="module")
def prompt_ids(smollm_tokenizer):
    return [smollm_tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]


def hf_greedy(model, ids: list[int], max_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False,
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()


def run(engine, requests: list[tuple[list[int], str | None]], max_tokens: int) -> list[list[int]]:
    """Submits every (prompt, adapter) at once and steps to the end."""
    tokens = {}
    for i, (ids, lora) in enumerate(requests):
        engine.add_request(f"q{i}", ids, greedy(max_tokens, ignore_eos=True), lora_name=lora)
        tokens[f"q{i}"] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    return [tokens[f"q{i}"] for i in range(len(requests))]


def test_base_and_every_adapter_in_one_batch_match_peft_greedy(lora_engine, adapters, hf_smollm, prompt_ids):
    requests = [(ids, lora) for lora in [None, *ADAPTERS] for ids in prompt_ids]
    ours = run(lora_engine, requests, 12)
    for (ids, lora), got in zip(requests, ours):
        reference = hf_smollm if lora is None else adapters[lora][1]
        assert got == hf_greedy(reference, ids, 12), f"adapter {lora}"


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_teacher_forced_logits_match_peft(lora_engine, adapters, prompt_ids, name):
    ids = prompt_ids[0] + prompt_ids[1]
    ours = lora_engine.prompt_logits(ids, lora_name=name)
    with torch.no_grad():
        theirs = adapters[name][1](torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=1e-4)


def test_an_adapter_changes_the_logits(lora_engine, prompt_ids):
    base = lora_engine.prompt_logits(prompt_ids[0])
    adapted = lora_engine.prompt_logits(prompt_ids[0], lora_name="all16")
    assert (base - adapted).abs().max() > 1e-2


def test_the_prefix_cache_keeps_adapters_apart(lora_engine, adapters, hf_smollm, prompt_ids):
    long = prompt_ids[0] * 8      # several full blocks, cached by the first run
    assert run(lora_engine, [(long, None)], 4)[0] == hf_greedy(hf_smollm, long, 4)
    assert run(lora_engine, [(long, "qv8")], 4)[0] == hf_greedy(adapters["qv8"][1], long, 4)


def test_more_adapters_than_slots_run_by_turns(smollm_source, smollm_weights, adapters, hf_smollm, prompt_ids):
    from worker.config import EngineConfig
    from worker.engine import LLMEngine
    cfg, model = smollm_weights
    engine = LLMEngine(EngineConfig(model="default", device="cpu", dtype="float32", num_blocks=256,
                                    enable_lora=True, max_loras=1), smollm_source, (cfg, copy.deepcopy(model)))
    for name, (path, _) in adapters.items():
        engine.add_lora(read_lora_adapter(name, path, cfg, 16))
    requests = [(prompt_ids[2], name) for name in ADAPTERS] + [(prompt_ids[2], None)]
    ours = run(engine, requests, 6)
    assert ours == [hf_greedy(adapters[name][1], prompt_ids[2], 6) for name in ADAPTERS] + \
        [hf_greedy(hf_smollm, prompt_ids[2], 6)]
    assert engine.lora.loads == len(ADAPTERS)


def test_plain_linears_fold_their_slots_a_into_their_weight_where_it_adds_few_rows(lora_engine):
    """Four slots of rank 16 on SmolLM2: q/k/v (960 rows) would grow by 3 x 64 rows, 20 %,
    so it keeps its own shrink; o, gate/up and down grow by 64 of 576, 128 of 3072, 64 of 576."""
    layers = lora_engine.runner.lora.layers
    assert {name: layers[(0, name)].folded for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")} \
        == {"qkv_proj": False, "o_proj": True, "gate_up_proj": True, "down_proj": True}
    assert layers[(0, "o_proj")].base.weight.shape == (576 + 4 * 16, 576)


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_a_folded_linear_computes_what_an_unfolded_one_does(monkeypatch, bias):
    """The same weights, slots and tokens (two adapters, the base model, an empty slot)
    through a folded and an unfolded LoRALinear; without adapters in the step, a folded one
    is its base linear."""
    from torch import nn

    import worker.lora
    from worker.context import AttentionMetadata, set_context
    from worker.lora import LoRALinear
    pieces = [(0, 24), (24, 8), (32, 8)]
    torch.manual_seed(0)
    base = nn.Linear(16, 40, bias=bias)
    x = torch.randn(6, 16)
    with torch.no_grad():
        want_base = base(x)
    made = {}
    for fold in (False, True):
        monkeypatch.setattr(worker.lora, "FOLD_MAX_EXTRA_ROWS", 1.0 if fold else 0.0)
        made[fold] = LoRALinear(copy.deepcopy(base), pieces, 16, 3, 4, torch.float32, torch.device("cpu"))
        assert made[fold].folded is fold
        g = torch.Generator().manual_seed(1)
        for slot in (0, 1):
            made[fold].load_slot(slot, (torch.randn(3, 4 - slot, 16, generator=g), torch.randn(40, 4 - slot, generator=g)))
    metadata = dict(slot_mapping=torch.zeros(6, dtype=torch.long), block_tables=torch.zeros(1, 1, dtype=torch.int32),
                    seq_lens=torch.ones(6, dtype=torch.int32), query_start_loc=torch.arange(7, dtype=torch.int32),
                    max_query_len=1, max_seq_len=1)
    try:
        set_context(AttentionMetadata(**metadata, lora_slots=torch.tensor([0, 1, -1, 1, 2, 0], dtype=torch.int32)))
        with torch.no_grad():
            unfolded, folded = made[False](x), made[True](x)
        set_context(AttentionMetadata(**metadata))
        with torch.no_grad():
            without_adapters = made[True](x)
    finally:
        set_context(None)
    torch.testing.assert_close(folded, unfolded, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(folded[[0, 1, 3, 5]], want_base[[0, 1, 3, 5]], atol=1e-2)
    torch.testing.assert_close(folded[[2, 4]], want_base[[2, 4]])
    torch.testing.assert_close(without_adapters, want_base)


def test_a_steps_tokens_are_grouped_by_adapter(lora_engine, prompt_ids):
    """Requests arriving adapters in turn run side by side per adapter, so each tile of the
    LoRA kernels meets as few adapters as the batch allows."""
    names = [None, "qv8", "all16", "mlp_rs"] * 2
    for i, name in enumerate(names):
        lora_engine.add_request(f"g{i}", prompt_ids[i % 3], greedy(3), lora_name=name)
    try:
        lora_engine.step()
        slots = [s.seq.lora_slot for s in lora_engine.last_plan.scheduled]
        assert len(slots) == len(names) and slots == sorted(slots) and len(set(slots)) == 4
    finally:
        for i in range(len(names)):
            lora_engine.abort(f"g{i}")


def test_an_unknown_adapter_is_refused_naming_it(lora_engine, prompt_ids):
    with pytest.raises(LoRANotFound, match="'nope' is not loaded"):
        lora_engine.add_request("x", prompt_ids[0], greedy(2), lora_name="nope")


def test_an_engine_without_lora_refuses_an_adapter_request(make_engine, prompt_ids):
    with pytest.raises(InvalidRequest, match="--enable-lora"):
        make_engine().add_request("x", prompt_ids[0], greedy(2), lora_name="qv8")


def test_an_adapter_in_use_cannot_be_removed(lora_engine, prompt_ids):
    lora_engine.add_request("busy", prompt_ids[0], greedy(4), lora_name="qv8")
    assert lora_engine.lora_in_use("qv8") == 1
    with pytest.raises(ValueError, match="still has 1 sequences"):
        lora_engine.remove_lora("qv8")
    lora_engine.abort("busy")
    assert lora_engine.lora_in_use("qv8") == 0


def test_host_memory_keeps_at_most_max_cpu_loras_dropping_the_least_recently_used_idle_one(
        smollm_source, smollm_weights, adapters, prompt_ids):
    from worker.config import EngineConfig
    from worker.engine import LLMEngine
    cfg, model = smollm_weights
    engine = LLMEngine(EngineConfig(model="default", device="cpu", dtype="float32", num_blocks=64, enable_lora=True,
                                    max_loras=1, max_cpu_loras=2), smollm_source, (cfg, copy.deepcopy(model)))
    read = {name: read_lora_adapter(name, path, cfg, 16) for name, (path, _) in adapters.items()}
    assert engine.add_lora(read["qv8"]) == [] and engine.add_lora(read["all16"]) == []
    engine.add_request("busy", prompt_ids[0], greedy(2), lora_name="qv8")
    assert engine.add_lora(read["mlp_rs"]) == ["all16"]        # qv8 is older, but in use
    assert list(engine.lora.adapters) == ["qv8", "mlp_rs"]
    engine.add_request("busy2", prompt_ids[0], greedy(2), lora_name="mlp_rs")
    with pytest.raises(InvalidRequest, match="have requests in flight"):
        engine.add_lora(read["all16"])


def test_the_offline_llm_serves_an_adapter_like_peft(tmp_path):
    from peft import LoraConfig, get_peft_model
    from helpers import save_tiny_llama
    from worker.llm import LLM
    base = save_tiny_llama(tmp_path / "base")
    torch.manual_seed(3)
    peft_model = get_peft_model(copy.deepcopy(base), LoraConfig(r=8, target_modules=["q_proj", "up_proj"],
                                                                init_lora_weights=False)).eval()
    peft_model.save_pretrained(tmp_path / "adapter")
    llm = LLM(str(tmp_path / "base"), device="cpu", dtype="float32", num_blocks=64, enable_lora=True)
    llm.add_lora("tiny", str(tmp_path / "adapter"))
    prompt = list(range(10, 30))
    ours = llm.generate([prompt], greedy(8, ignore_eos=True), lora_name="tiny")[0].choices[0].token_ids
    assert ours == hf_greedy(peft_model, prompt, 8)
    assert ours != llm.generate([prompt], greedy(8, ignore_eos=True))[0].choices[0].token_ids


# ---------------------------------------------------------------- refusals of the checkpoint reader

def test_rank_above_the_limit_is_refused(adapters, smollm_weights):
    with pytest.raises(LoRAAdapterError, match="rank 16, above --max-lora-rank 8"):
        read_lora_adapter("all16", adapters["all16"][0], smollm_weights[0], max_rank=8)


def test_an_adapter_of_another_base_model_is_refused(tmp_path, smollm_weights):
    from peft import LoraConfig, get_peft_model
    from helpers import tiny_llama
    get_peft_model(tiny_llama(), LoraConfig(r=4, target_modules=["q_proj"])).save_pretrained(tmp_path)
    with pytest.raises(LoRAAdapterError, match="another base model"):
        read_lora_adapter("other", str(tmp_path), smollm_weights[0], max_rank=16)


def test_a_corrupt_weights_file_is_refused_naming_it(adapters, smollm_weights, tmp_path):
    import shutil
    shutil.copytree(adapters["qv8"][0], tmp_path / "bad")
    (tmp_path / "bad" / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(LoRAAdapterError, match="adapter_model.safetensors: unreadable"):
        read_lora_adapter("bad", str(tmp_path / "bad"), smollm_weights[0], max_rank=16)


def test_an_adapter_holding_nan_is_refused_naming_the_tensor(adapters, smollm_weights, tmp_path):
    import shutil
    from safetensors.torch import load_file, save_file
    shutil.copytree(adapters["qv8"][0], tmp_path / "nan")
    weights_file = tmp_path / "nan" / "adapter_model.safetensors"
    tensors = load_file(weights_file)
    key = sorted(tensors)[0]
    tensors[key][0, 0] = float("nan")
    save_file(tensors, weights_file)
    with pytest.raises(LoRAAdapterError, match=f"tensor {key!r} holds NaN or infinite values"):
        read_lora_adapter("nan", str(tmp_path / "nan"), smollm_weights[0], max_rank=16)


def test_a_missing_directory_is_refused(smollm_weights, tmp_path):
    with pytest.raises(LoRAAdapterError, match="no such directory"):
        read_lora_adapter("gone", str(tmp_path / "gone"), smollm_weights[0], max_rank=16)


def test_a_dora_adapter_is_refused(adapters, smollm_weights, tmp_path):
    import shutil
    shutil.copytree(adapters["qv8"][0], tmp_path / "dora")
    config_file = tmp_path / "dora" / "adapter_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "use_dora": True}))
    with pytest.raises(LoRAAdapterError, match="DoRA"):
        read_lora_adapter("dora", str(tmp_path / "dora"), smollm_weights[0], max_rank=16)


def test_an_embedding_target_is_refused(hf_smollm, smollm_weights, tmp_path):
    from peft import LoraConfig, get_peft_model
    get_peft_model(copy.deepcopy(hf_smollm), LoraConfig(r=4, target_modules=["q_proj", "embed_tokens"])
                   ).save_pretrained(tmp_path)
    with pytest.raises(LoRAAdapterError, match="embed_tokens"):
        read_lora_adapter("emb", str(tmp_path), smollm_weights[0], max_rank=16)


# ---------------------------------------------------------------- the GPU path

def write_peft_adapter(path, model_config, layers: int, rank: int, modules: list[str], seed: int) -> dict:
    """A PEFT-format adapter directory with random A and B (safetensors, PEFT's tensor names);
    returns {(layer, module): (A, B)} for merging. Written by hand: peft does not travel to
    the GPU machine, and the file format is what is under test there."""
    from safetensors.torch import save_file
    from worker.models.lora_checkpoint import projection_shapes
    shapes = projection_shapes(model_config)
    g = torch.Generator().manual_seed(seed)
    tensors, pairs = {}, {}
    for layer in range(layers):
        for module in modules:
            fan_in, fan_out = shapes[module]
            a = torch.randn(rank, fan_in, generator=g) / fan_in ** 0.5
            b = torch.randn(fan_out, rank, generator=g) * 0.05
            where = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{where}.{module}"
            tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"] = a, b
            pairs[layer, where, module] = (a, b)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                          "target_modules": modules}))
    return pairs


@pytest.mark.gpu
@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_gpu_adapters_mixed_in_one_batch_equal_their_merged_models(tmp_path, eager):
    """Each adapter's greedy tokens and logits equal those of the base model with the adapter
    merged into its weights (W + 2 B A), all adapters and the base in one batch."""
    from helpers import save_tiny_llama
    from worker.config import EngineConfig
    from worker.engine import LLMEngine
    hf = save_tiny_llama(tmp_path / "base", hidden_size=256, layers=3)
    settings = dict(device="cuda", dtype="float32", num_blocks=256, enforce_eager=eager)
    base_cfg = LLMEngine(EngineConfig(model=str(tmp_path / "base"), **settings)).model_config
    modules = {"qkvo": ["q_proj", "k_proj", "v_proj", "o_proj"], "mlp": ["gate_proj", "up_proj", "down_proj"]}
    merged_engines = {}
    for seed, (name, targets) in enumerate(modules.items()):
        pairs = write_peft_adapter(tmp_path / name, base_cfg, 3, 8, targets, seed)
        merged = copy.deepcopy(hf)
        with torch.no_grad():
            for (layer, where, module), (a, b) in pairs.items():
                getattr(getattr(merged.model.layers[layer], where), module).weight += 2.0 * b @ a
        merged.save_pretrained(tmp_path / f"merged-{name}")
        merged_engines[name] = LLMEngine(EngineConfig(model=str(tmp_path / f"merged-{name}"), **settings))
    engine = LLMEngine(EngineConfig(model=str(tmp_path / "base"), enable_lora=True, max_loras=2,
                                    lora_modules={n: str(tmp_path / n) for n in modules}, **settings))
    prompts = [torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 37, 80)]
    requests = [(p, name) for name in [None, *modules] for p in prompts]
    ours = run(engine, requests, 16)
    base_engine = LLMEngine(EngineConfig(model=str(tmp_path / "base"), **settings))
    for (prompt, name), got in zip(requests, ours):
        reference = base_engine if name is None else merged_engines[name]
        assert got == run(reference, [(prompt, None)], 16)[0], f"adapter {name}"
    for name in modules:
        torch.testing.assert_close(engine.prompt_logits(prompts[2], lora_name=name),
                                   merged_engines[name].prompt_logits(prompts[2]), atol=2e-3, rtol=1e-3)

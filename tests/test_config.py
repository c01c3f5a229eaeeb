"""worker/config.py: the engine's settings, their checks and the defaults left to the device."""

import pytest

from worker.config import DEFAULT_LONG_PREFILL_TOKENS, DEFAULT_STEP_TOKENS, EngineConfig


def test_a_gpu_takes_4096_token_steps_and_asynchronous_scheduling_by_default():
    config = EngineConfig(model="default").for_device("cuda")
    assert config.max_num_batched_tokens == DEFAULT_STEP_TOKENS["cuda"] == 4096
    assert config.async_scheduling is True


def test_a_gpu_lets_one_prompt_take_the_whole_step_and_the_cpu_512_tokens_of_it_by_default():
    assert EngineConfig(model="default").for_device("cuda").long_prefill_token_threshold == 0
    cpu = EngineConfig(model="default").for_device("cpu")
    assert cpu.long_prefill_token_threshold == DEFAULT_LONG_PREFILL_TOKENS["cpu"] == 512


def test_the_cpu_takes_2048_token_steps_without_asynchronous_scheduling_by_default():
    config = EngineConfig(model="default").for_device("cpu")
    assert config.max_num_batched_tokens == DEFAULT_STEP_TOKENS["cpu"] == 2048
    assert config.async_scheduling is False


@pytest.mark.parametrize("device_type", ["cuda", "cpu"])
def test_settings_given_are_kept_on_any_device(device_type):
    config = EngineConfig(model="default", max_num_batched_tokens=512, async_scheduling=False,
                          long_prefill_token_threshold=0)
    resolved = config.for_device(device_type)
    assert (resolved.max_num_batched_tokens, resolved.async_scheduling, resolved.long_prefill_token_threshold) == \
        (512, False, 0)
    assert resolved == config


def test_the_defaults_are_left_to_the_device_until_it_is_known():
    config = EngineConfig(model="default")
    assert config.max_num_batched_tokens is None and config.async_scheduling is None
    assert config.long_prefill_token_threshold is None


@pytest.mark.parametrize("budget", [0, -1])
def test_a_step_budget_below_one_is_refused_naming_the_setting(budget):
    with pytest.raises(ValueError, match=f"max_num_batched_tokens={budget} must be >= 1"):
        EngineConfig(model="default", max_num_batched_tokens=budget).validate()


@pytest.mark.parametrize("setting, value, message", [
    ("max_model_len", 0, "max_model_len=0 must be >= 1"),
    ("kv_cache_memory_gb", -1.0, "kv_cache_memory_gb=-1.0 must be above 0"),
    ("kv_cache_memory_gb", float("nan"), "kv_cache_memory_gb=nan must be above 0"),
    ("swap_space_gb", -1.0, "swap_space_gb=-1.0 must be >= 0"),
    ("stall_timeout_s", float("nan"), "stall_timeout_s=nan must be >= 0"),
    ("max_lora_rank", 1000, r"max_lora_rank=1000 must be in \[1, 256\]"),
])
def test_a_size_out_of_range_is_refused_naming_the_setting(setting, value, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        EngineConfig(model="default", **{setting: value}).validate()


@pytest.mark.parametrize("device", ["tpu", "cuda:x", "CPU", ""])
def test_a_device_other_than_auto_cpu_or_cuda_is_refused_naming_what_is_allowed(device):
    with pytest.raises(ValueError, match=f"^device={device!r} is not supported: use auto, cpu, cuda or cuda:<index>$"):
        EngineConfig(model="default", device=device).validate()


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:1"])
def test_the_devices_a_worker_runs_on_pass_validation(device):
    assert EngineConfig(model="default", device=device).validate().device == device

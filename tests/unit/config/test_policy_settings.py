"""A policy section resolved once (config.policy_settings): what validate resolves is what the
workers get, picklable; generation's keys have one reader with NeMo-RL's defaults."""

from __future__ import annotations

import copy
import pickle

import pytest

from nemo_rl_offload.config.generation_settings import GenerationSettings, SamplingSettings
from nemo_rl_offload.config.loader import load_recipe
from nemo_rl_offload.preflight import check_recipe, resolve_policy

FGO = "examples/configs/grpo_math_1B_megatron_fgo.yaml"


@pytest.fixture(scope="module")
def fgo_report():
    return check_recipe(load_recipe(FGO))


def test_validate_resolves_each_section_once_with_what_the_recipe_says(fgo_report) -> None:
    assert fgo_report.ok, fgo_report.errors
    assert set(fgo_report.policies) == {"policy"}
    policy = fgo_report.policies["policy"]
    section = fgo_report.recipe["policy"]
    assert policy.where == "policy"
    assert policy.architecture.name == section["model_name"]
    assert policy.max_total_sequence_length == section["max_total_sequence_length"]
    assert policy.offload_modules == tuple(section["megatron_cfg"]["offload_modules"])
    # Packing on: every training step is one pack of train_mb_tokens, the only bucket.
    assert policy.batching.mode == "packing"
    assert policy.offload.sequence_buckets == (section["sequence_packing"]["train_mb_tokens"],)
    assert not policy.offload.default_buckets
    mcore = section["generation"]["mcore_generation_config"]
    assert policy.generation.engine.cuda_graphs
    assert policy.generation.engine.num_cuda_graphs == mcore["num_cuda_graphs"]
    assert policy.generation.max_new_tokens == section["generation"]["max_new_tokens"]


def test_resolved_settings_cross_process_boundaries_unchanged(fgo_report) -> None:
    policy = fgo_report.policies["policy"]
    assert pickle.loads(pickle.dumps(policy)) == policy


def test_a_bare_section_resolves_as_validate_resolves_it(fgo_report) -> None:
    section = copy.deepcopy(fgo_report.recipe["policy"])
    assert resolve_policy(section) == fgo_report.policies["policy"]


def test_a_recipe_with_errors_hands_out_no_settings() -> None:
    recipe = load_recipe(FGO, ["policy.megatron_cfg.offload_modules=[not_a_module]"])
    report = check_recipe(recipe)
    assert report.errors and report.policies == {}


def test_offload_modules_run_only_with_offloading_on(fgo_report) -> None:
    section = copy.deepcopy(fgo_report.recipe["policy"])
    section["megatron_cfg"]["fine_grained_activation_offloading"] = False
    off = resolve_policy(section)
    assert off.offload_modules == ()
    assert off.effective.listed_offload_modules == ()  # an explicit false clears the list


def test_new_tokens_fill_the_room_unless_the_section_limits_them() -> None:
    unlimited = GenerationSettings.from_section({})
    assert unlimited.max_new_tokens is None
    assert unlimited.new_tokens(longest_prompt=100, max_total_length=512) == 412
    limited = GenerationSettings.from_section({"generation": {"max_new_tokens": 64}})
    assert limited.new_tokens(longest_prompt=100, max_total_length=512) == 64
    assert limited.new_tokens(longest_prompt=500, max_total_length=512) == 12
    assert limited.new_tokens(longest_prompt=512, max_total_length=512) == 0


def test_a_call_stops_at_the_sections_stops_and_the_tokenizers_end() -> None:
    generation = GenerationSettings.from_section(
        {"generation": {"stop_token_ids": [7, 9], "temperature": 0.6, "top_p": 0.9, "top_k": 20}}
    )
    call = generation.sampling(max_new_tokens=5, eos_id=2, greedy=True, vocab_limit=300)
    assert call == SamplingSettings(
        max_new_tokens=5,
        temperature=0.6,
        top_p=0.9,
        top_k=20,
        greedy=True,
        stop_token_ids=(7, 9, 2),
        vocab_limit=300,
    )
    assert generation.sampling(max_new_tokens=5, eos_id=None).stop_token_ids == (7, 9)


def test_validation_rollouts_fall_back_to_the_training_sampling() -> None:
    plain = GenerationSettings.from_section({"generation": {"temperature": 0.8}})
    assert plain.val_temperature is None and plain.val_top_p is None
    own = GenerationSettings.from_section(
        {"generation": {"val_temperature": 0.3, "val_top_p": 0.5}}
    )
    assert (own.val_temperature, own.val_top_p) == (0.3, 0.5)

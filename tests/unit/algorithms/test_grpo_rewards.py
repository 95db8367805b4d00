"""GRPO's reward and advantage options (algorithms/rewards.py and their wiring in
algorithms/grpo.py), each shown to change what trains: reward scaling and shaping, dynamic
sampling with batch_multiplier and its batch limit, overlong filtering, advantage clipping,
and validation's samples per prompt with pass@k. Generation and scoring are stand-ins, so the
step's data path runs without workers."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from nemo_rl_offload.algorithms import grpo, rewards
from nemo_rl_offload.algorithms.batching import TokenSequence
from nemo_rl_offload.algorithms.common import EpochSampler
from nemo_rl_offload.config.generation_settings import GenerationSettings
from nemo_rl_offload.config.run_settings import LoggerSettings
from nemo_rl_offload.data.tokenizer import ByteTokenizer
from nemo_rl_offload.errors import UserInputError
from nemo_rl_offload.policy.generation import Generated
from nemo_rl_offload.progress import Progress

TOKENIZER = ByteTokenizer()
EOS = TOKENIZER.eos_id


# ----------------------------------------------------------------------------- pure functions


def test_a_response_is_truncated_when_it_does_not_end_with_a_stop_token():
    assert rewards.truncated([5, 6, 7], (EOS,))
    assert not rewards.truncated([5, 6, EOS], (EOS,))
    assert not rewards.truncated([5, 9], (9, EOS))  # a recipe's stop_token_ids end it too
    assert rewards.truncated([], (EOS,))


def test_reward_scaling_clamps_to_the_source_range_and_maps_it_onto_the_target():
    scores = torch.tensor([-1.0, 0.0, 0.5, 1.0, 2.0])
    cfg = {"enabled": True, "source_min": 0.0, "source_max": 1.0, "target_min": -1.0}
    assert rewards.scale_rewards(scores, cfg).tolist() == [-1.0, -1.0, 0.0, 1.0, 1.0]
    assert rewards.scale_rewards(scores, {**cfg, "enabled": False}) is scores
    assert rewards.scale_rewards(scores, None) is scores


def test_dapo_overlong_shaping_penalizes_linearly_past_the_expected_length():
    cfg = {
        "enabled": True,
        "overlong_buffer_length": 4,
        "overlong_buffer_penalty": 1.0,
        "max_response_length": 10,
    }
    shaped = rewards.shape_rewards(torch.ones(5), [5, 6, 8, 10, 12], [False] * 5, cfg)
    # expected length 10 - 4 = 6: no bonus below it, -1 per 4 tokens beyond it
    assert shaped.tolist() == pytest.approx([1.0, 1.0, 0.5, 0.0, -0.5])
    unshaped = rewards.shape_rewards(torch.ones(5), [5, 6, 8, 10, 12], [False] * 5, None)
    assert unshaped.tolist() == [1.0] * 5


def test_the_stop_properly_coefficient_scales_truncated_rewards_and_replaces_dapo():
    cfg = {
        "enabled": True,
        "stop_properly_penalty_coef": 0.25,
        "overlong_buffer_length": 1,
        "overlong_buffer_penalty": 10.0,
        "max_response_length": 1,
    }
    shaped = rewards.shape_rewards(
        torch.tensor([1.0, 1.0, 0.5]), [50, 50, 50], [True, False, True], cfg
    )
    assert shaped.tolist() == [0.25, 1.0, 0.125]


def test_advantages_are_clamped_from_below_and_above_each_side_optional():
    advantages = torch.tensor([-3.0, -0.5, 0.0, 0.5, 3.0])
    assert rewards.clip_advantages(advantages, -1.0, 1.0).tolist() == [-1, -0.5, 0, 0.5, 1]
    assert rewards.clip_advantages(advantages, -1.0, None).tolist() == [-1, -0.5, 0, 0.5, 3]
    assert rewards.clip_advantages(advantages, None, None).tolist() == advantages.tolist()


def test_dynamic_sampling_gathers_samples_until_enough_and_fails_past_the_batch_limit():
    gathering = rewards.DynamicSampling[str](needed=5, max_gen_batches=2)
    assert not gathering.add(["a", "b"], [[True, True], [False, True]], torch.tensor([1.0] * 4))
    # batch 2 of at most 2 keeps nothing: go on, and its rewards are not NeMo-RL's `reward`
    assert not gathering.add(["c"], [[False, False]], torch.tensor([0.0, 0.0]))
    assert gathering.samples() == 3
    with pytest.raises(UserInputError, match=r"grpo\.dynamic_sampling_max_gen_batches: 3 "):
        gathering.add(["e"], [[True]], torch.tensor([1.0]))  # the third batch still short
    full = rewards.DynamicSampling[str](needed=3, max_gen_batches=1)
    assert full.add(["a", "b"], [[True, False, True], [True, True, False]], torch.arange(6.0))
    # samples, not groups: b's first sample completes the step, its second is discarded
    assert full.take() == ([("a", [0, 2]), ("b", [0])], 1)
    assert full.reward() == pytest.approx(1.0)  # the first 3 unfiltered rewards: 0, 1, 2


# --------------------------------------------------------------------- the step's data path

# Prompts "u<i>" are answered alike by all their samples; prompts "v<i>" half right, half
# wrong, so only the latter give a signal; prompts "w<i>" have one right answer among four.
# A response is the answer digit, then eos.


def fake_run(grpo_cfg: dict, **generation) -> SimpleNamespace:
    recipe = {
        "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 4, **grpo_cfg},
        "policy": {"generation": {"max_new_tokens": 8, "temperature": 1.0, **generation}},
        "logger": {},
    }
    return SimpleNamespace(
        recipe=recipe,
        policy_settings=SimpleNamespace(
            generation=GenerationSettings.from_section(recipe["policy"]), records_routes=False
        ),
        settings=SimpleNamespace(
            logger=LoggerSettings("logs", False, False, num_val_samples_to_print=0)
        ),
        tokenizer=TOKENIZER,
        max_len=64,
        progress=Progress(enabled=False),
    )


class FakePolicy:
    workers = 1

    def __init__(self, truncate: bool = False) -> None:
        self.calls: list[int] = []
        self.truncate = truncate

    def phase_peak_gib(self) -> float:
        return 0.0  # as CPU workers report

    def generate(self, prompts, settings, *, seed, pad_id, record_routes=False):
        assert not record_routes  # no router replay in these recipes
        self.calls.append(len(prompts))
        out = []
        for index, ids in enumerate(prompts):
            text = TOKENIZER.decode(ids)
            right = {"u": True, "v": index % 2 == 1, "w": index % 4 == 0}[text[0]]
            digit = "1" if right else "0"
            tail = [] if self.truncate and index % 4 == 3 else [EOS]
            ids = TOKENIZER.encode(digit) + tail
            # log-probabilities that name their response, to follow them through the filters
            out.append(Generated(ids, [-float(ids[0] + index)] * len(ids)))
        return out


class RightIsOne:
    def score(self, texts, answers):
        return [1.0 if t.strip() == a else 0.0 for t, a in zip(texts, answers, strict=True)]


def data(names: list[str]) -> tuple[list[TokenSequence], list[str]]:
    """The prompts and their answers (every answer is "1")."""
    return [TokenSequence(TOKENIZER.encode(n), len(n)) for n in names], ["1"] * len(names)


def collect(run, names, policy=None):
    sampler = EpochSampler(len(names), seed=0, shuffle=False)
    groups, metrics = grpo.collect_groups(
        run, policy or FakePolicy(), RightIsOne(), data(names), sampler, seed=1
    )
    return groups, metrics, sampler


def prompt_names(groups) -> list[str]:
    return [TOKENIZER.decode(g.prompt.ids) for g in groups]


def test_without_dynamic_sampling_a_step_takes_its_prompts_as_they_come():
    groups, metrics, sampler = collect(fake_run({}), ["u0", "u1", "v0", "v1"])
    assert prompt_names(groups) == ["u0", "u1"] and sampler.position == 2
    assert "filtered_reward" not in metrics and metrics["reward"] == 1.0


def test_dynamic_sampling_drops_groups_without_variance_and_generates_again():
    run = fake_run({"use_dynamic_sampling": True})
    groups, metrics, sampler = collect(run, ["u0", "u1", "v0", "v1"])
    assert prompt_names(groups) == ["v0", "v1"] and sampler.position == 4
    assert metrics["dynamic_sampling_num_gen_batches"] == 2
    # NeMo-RL's `reward` counts only generation batches that kept a sample (here the second)
    assert metrics["filtered_reward"] == 0.5 and metrics["reward"] == 0.5
    # each kept response keeps its own sampler log-probabilities (both groups: batch 2)
    for g, first in zip(groups, (0, 4), strict=True):
        for offset, (response, logprobs) in enumerate(zip(g.responses, g.logprobs, strict=True)):
            assert logprobs == [-float(response[0] + first + offset)] * len(response)


def test_batch_multiplier_widens_each_generation_batch_and_extra_groups_are_discarded():
    run = fake_run({"use_dynamic_sampling": True, "batch_multiplier": 2.5})
    policy = FakePolicy()
    groups, metrics, sampler = collect(run, ["v0", "u0", "v1", "v2", "u1"], policy)
    assert policy.calls == [5 * 4]  # int(2 x 2.5) prompts, 4 samples each, in one batch
    assert prompt_names(groups) == ["v0", "v1"] and sampler.position == 5
    assert metrics["dynamic_sampling_num_discarded_valid_samples"] == 4  # v2's group


def test_dynamic_sampling_drops_the_lone_right_answer_with_leave_one_out():
    """NeMo-RL filters samples by their own spread, the other samples' with
    grpo.use_leave_one_out_baseline: of [1, 0, 0, 0] the right one is dropped, the wrong
    three kept; a step of 2 x 4 samples then takes 3 + 3 + 2 of them."""
    run = fake_run({"use_dynamic_sampling": True})
    groups, metrics, sampler = collect(run, ["w0", "w1", "w2", "w3"])
    assert prompt_names(groups) == ["w0", "w1", "w2"] and sampler.position == 4
    assert [len(g.responses) for g in groups] == [3, 3, 2]
    assert [g.rewards.tolist() for g in groups] == [[0.0] * 3, [0.0] * 3, [0.0] * 2]
    assert metrics["dynamic_sampling_num_discarded_valid_samples"] == 4
    assert metrics["filtered_reward"] == 0.0 and metrics["reward"] == 0.25
    # each kept response keeps its own sampler log-probabilities (w0: batch 1, indices 1..3)
    assert [lp[0] for lp in groups[0].logprobs] == [-float(ord("0") + i) for i in (1, 2, 3)]
    # what is left of a prompt trains against itself: all wrong, all advantages 0
    _, advantages = grpo.training_sequences(groups, {})
    assert advantages.tolist() == [0.0] * 8
    whole = fake_run({"use_dynamic_sampling": True, "use_leave_one_out_baseline": False})
    groups, metrics, _ = collect(whole, ["w0", "w1", "w2", "w3"])
    assert [len(g.responses) for g in groups] == [4, 4]
    assert metrics["dynamic_sampling_num_gen_batches"] == 1


def test_dynamic_sampling_stops_the_run_past_its_generation_batch_limit():
    run = fake_run({"use_dynamic_sampling": True, "dynamic_sampling_max_gen_batches": 2})
    with pytest.raises(UserInputError, match="grpo.dynamic_sampling_max_gen_batches: 3 "):
        collect(run, ["u0", "u1"])


def test_dynamic_sampling_looks_at_rewards_before_length_shaping():
    """All samples of u-prompts are right; shaping that penalizes by length alone must not
    make them count as varied (NeMo-RL filters on the unshaped reward)."""
    shaping = {
        "enabled": True,
        "overlong_buffer_length": 1,
        "overlong_buffer_penalty": 1.0,
        "max_response_length": 1,
    }
    run = fake_run({"use_dynamic_sampling": True, "reward_shaping": shaping})
    policy = FakePolicy(truncate=True)  # every 4th response lacks eos: lengths differ
    groups, _, _ = collect(run, ["u0", "u1", "v0", "v1"], policy)
    assert prompt_names(groups) == ["v0", "v1"]
    assert len(set(groups[0].rewards.tolist())) > 1  # shaped rewards do differ


def test_reward_scaling_and_shaping_reach_the_rewards_that_advantages_use():
    shaping = {"enabled": True, "stop_properly_penalty_coef": 0.5}
    scaling = {"enabled": True, "target_min": -1.0, "target_max": 1.0}
    run = fake_run({"reward_scaling": scaling, "reward_shaping": shaping})
    groups, metrics, _ = collect(run, ["v0", "v1"], FakePolicy(truncate=True))
    # samples: wrong, right, wrong, right-but-truncated -> scaled -1, 1, -1, 1 -> shaped
    assert groups[0].rewards.tolist() == [-1.0, 1.0, -1.0, 0.5]
    assert groups[0].scaled.tolist() == [-1.0, 1.0, -1.0, 1.0]
    assert groups[0].truncated == [False, False, False, True]
    assert metrics["reward"] == pytest.approx(-0.125)


def one_group(truncated: list[bool]) -> grpo.PromptGroup:
    scores = torch.tensor([0.0, 1.0, 1.0, 0.0])
    responses = [[3, EOS], [4, EOS], [5], [6, EOS]]
    logprobs = [[-0.5] * len(r) for r in responses]
    return grpo.PromptGroup(
        TokenSequence([1, 2], 2), responses, scores, scores, truncated, logprobs
    )


def test_overlong_filtering_masks_truncated_responses_but_keeps_their_advantages():
    group = one_group([False, False, True, False])
    plain, plain_adv = grpo.training_sequences([group], {})
    filtered, filtered_adv = grpo.training_sequences([group], {"overlong_filtering": True})
    assert [s.loss_multiplier for s in plain] == [1.0, 1.0, 1.0, 1.0]
    assert [s.loss_multiplier for s in filtered] == [1.0, 1.0, 0.0, 1.0]
    # the truncated sample still counts in its group's baseline and spread
    assert torch.equal(plain_adv, filtered_adv)
    assert [s.extras["advantages"] for s in filtered] == filtered_adv.tolist()


def test_the_advantages_read_grpo_adv_estimator_and_leave_grpos_own_keys_alone():
    group = one_group([False] * 4)  # rewards 0, 1, 1, 0
    _, default = grpo.training_sequences([group], {})
    # each sample's others: one like it, two not: mean 1/3 or 2/3, spread 1/sqrt(3)
    step = 2 / 3 * math.sqrt(3)
    assert default.tolist() == pytest.approx([-step, step, step, -step], rel=1e-5)
    _, alone = grpo.training_sequences(
        [group], {"normalize_rewards": False, "use_leave_one_out_baseline": False}
    )
    assert torch.equal(alone, default)  # not read by NeMo-RL's estimator either
    _, plain = grpo.training_sequences(
        [group],
        {"adv_estimator": {"normalize_rewards": False, "use_leave_one_out_baseline": False}},
    )
    assert plain.tolist() == [-0.5, 0.5, 0.5, -0.5]


def test_advantage_clipping_reaches_the_training_sequences():
    group = one_group([False] * 4)
    _, unclipped = grpo.training_sequences([group], {})
    sequences, clipped = grpo.training_sequences(
        [group], {"advantage_clip_low": -0.5, "advantage_clip_high": 0.25}
    )
    assert unclipped.abs().max() > 1.0
    assert clipped.tolist() == [-0.5, 0.25, 0.25, -0.5]
    assert [s.extras["advantages"] for s in sequences] == [-0.5, 0.25, 0.25, -0.5]


def test_validation_samples_each_prompt_as_often_as_asked_and_reports_pass_at_k():
    run = fake_run({})
    policy = FakePolicy()
    val, answers = data(["v0", "u0"])
    once = grpo.validate(run, policy, RightIsOne(), val, answers, 0)
    assert policy.calls == [2, 2] and "val_pass_k" not in once
    policy.calls.clear()
    metrics = grpo.validate(run, policy, RightIsOne(), val, answers, 0, samples_per_prompt=4)
    assert policy.calls == [8, 2]  # 4 sampled per prompt, then greedy once each
    assert metrics["val_pass_k"] == 1.0 and metrics["val_reward"] == 0.75

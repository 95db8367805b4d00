"""Token-budget micro-batches (algorithms.packing): NeMo-RL's packers, the packed row's layout,
dynamic batching's cuts, and per-sequence results landing on the right positions."""

from __future__ import annotations

import numpy as np
import pytest

from nemo_rl_offload.algorithms import packing
from nemo_rl_offload.algorithms.batching import TokenSequence, make_microbatch
from nemo_rl_offload.config.batching_settings import BatchingSettings
from nemo_rl_offload.errors import UserInputError

PAD = 0


def _sequences(lengths, seed=0, prompt=2, advantages=False):
    rng = np.random.default_rng(seed)
    return [
        TokenSequence(
            [int(t) for t in rng.integers(1, 100, n)],
            prompt,
            {"advantages": float(i) + 0.5} if advantages else {},
        )
        for i, n in enumerate(lengths)
    ]


LENGTHS = [37, 5, 64, 12, 30, 30, 8, 50, 21, 3, 44, 17]


@pytest.mark.parametrize("algorithm", sorted(packing.PACKERS))
def test_every_packer_places_each_sequence_once_within_capacity(algorithm):
    bins = packing.pack(LENGTHS, 64, algorithm)
    assert sorted(i for b in bins for i in b) == list(range(len(LENGTHS)))
    assert all(sum(LENGTHS[i] for i in b) <= 64 for b in bins)
    assert all(b for b in bins)


def test_modified_first_fit_decreasing_pairs_large_with_medium_and_fills_small_ones():
    # Capacity 60: large > 30, medium (20, 30], small (10, 20], tiny <= 10. 31 takes the
    # medium 25 (40 has no room for it); 40 takes the largest rest that fits (18); the rest
    # is packed first-fit decreasing.
    lengths = [40, 25, 18, 15, 15, 9, 31]
    bins = packing.pack(lengths, 60, "modified_first_fit_decreasing")
    assert sorted(sorted(lengths[i] for i in b) for b in bins) == [
        [9, 15, 15],
        [18, 40],
        [25, 31],
    ]


def test_packs_count_is_a_multiple_of_the_ranks_and_at_least_one_each():
    bins = packing.pack([10, 10, 10], 64, "first_fit_decreasing", bins_multiple_of=2)
    assert len(bins) == 2 and sorted(len(b) for b in bins) == [1, 2]
    bins = packing.pack(LENGTHS, 64, "modified_first_fit_decreasing", bins_multiple_of=4)
    assert len(bins) % 4 == 0
    with pytest.raises(ValueError, match="cannot fill"):
        packing.pack([10], 64, "concatenative", bins_multiple_of=2)


def test_a_sequence_longer_than_the_pack_is_refused():
    with pytest.raises(ValueError, match="does not fit"):
        packing.pack([65], 64, "first_fit_decreasing")


def test_a_pack_holds_each_sequence_as_its_padded_row_would():
    sequences = _sequences([7, 4, 9], advantages=True)
    sequences[2].env_spans = ((5, 7),)  # a multi-turn rollout's tool result
    packed = packing.pack_microbatch(sequences, pad_id=PAD, length=24)
    padded = make_microbatch(sequences, pad_id=PAD)
    assert packed["input_ids"].shape == (1, 24)
    assert packed["cu_seqlens"].tolist() == [0, 7, 11, 20, 24]  # the padding is a segment too
    start = 0
    for row, seq in enumerate(sequences):
        n = len(seq.ids)
        for key in ("input_ids", "labels", "loss_mask"):
            np.testing.assert_array_equal(packed[key][0, start : start + n], padded[key][row, :n])
        assert packed["position_ids"][0, start : start + n].tolist() == list(range(n))
        assert set(packed["segment_ids"][0, start : start + n].tolist()) == {row}
        # The per-sequence advantage is spread over the sequence's positions.
        assert set(packed["advantages"][0, start : start + n].tolist()) == {row + 0.5}
        start += n
    assert packed["loss_mask"][0, 20:].sum() == 0 and set(packed["segment_ids"][0, 20:]) == {-1}
    assert packed["loss_mask"][0, 6] == 0  # a sequence's last token has no label in the pack
    # the tool result's tokens are no labels that train (positions 4 and 5 predict them)
    assert packed["loss_mask"][0, 11 + 4 : 11 + 6].tolist() == [0, 0]


def _settings(mode, **kw):
    base = {
        "train_micro_batch_size": 2,
        "max_total_sequence_length": 64,
        "make_sequence_length_divisible_by": 8,
    }
    if mode == "packing":
        base["sequence_packing"] = {"enabled": True, "train_mb_tokens": 100, **kw}
    elif mode == "dynamic":
        base["dynamic_batching"] = {
            "enabled": True,
            "train_mb_tokens": 128,
            "logprob_mb_tokens": 256,
            "sequence_length_round": 16,
            **kw,
        }
    return packing.BatchingSettings.from_policy(base)


def test_settings_from_a_policy_section():
    assert _settings("rows").mode == "rows"
    packed = _settings("packing")
    assert packed.mode == "packing" and packed.pack_length() == 104  # 100 rounded up to 8
    # NeMo-RL's recipes default logprob_mb_tokens to the rows' worth of longest sequences.
    assert packed.logprob_tokens == 64 * 2
    assert _settings("packing", microbatch_order="largest_first").largest_first
    assert _settings("dynamic").sequence_length_round == 16
    assert BatchingSettings.mode_of({"dynamic_batching": {"enabled": True}}) != "rows"
    assert BatchingSettings.mode_of({"sequence_packing": {"enabled": False}}) == "rows"


def test_packed_training_steps_have_one_shape_and_the_same_count_on_every_rank():
    settings = _settings("packing")
    for seed in range(4):
        lengths = np.random.default_rng(seed).integers(3, 64, 13).tolist()
        batches = packing.training_batches(_sequences(lengths, seed), settings, 3, pad_id=PAD)
        assert len({len(shard) for shard in batches.shards}) == 1
        assert {mb["input_ids"].shape for mb in batches.flat} == {(1, 104)}
        total = sum(int(mb["cu_seqlens"][-1]) for mb in batches.flat)
        assert total == 104 * len(batches.flat)
        assert sum(mb["loss_mask"].sum() for mb in batches.flat) == sum(n - 2 for n in lengths)


def test_largest_first_orders_each_ranks_packs_by_tokens():
    settings = _settings("packing", microbatch_order="largest_first")
    batches = packing.training_batches(_sequences(LENGTHS), settings, 2, pad_id=PAD)
    for shard in batches.shards:
        used = [int((mb["segment_ids"] >= 0).sum()) for mb in shard]
        assert used == sorted(used, reverse=True)


def test_dynamic_batches_cut_at_the_same_rows_on_every_rank_within_the_budget():
    settings = _settings("dynamic")
    lengths = [9, 60, 33, 17, 17, 41, 5, 26, 50, 12, 3, 28]
    batches = packing.training_batches(_sequences(lengths), settings, 2, pad_id=PAD)
    counts = [[mb["input_ids"].shape[0] for mb in shard] for shard in batches.shards]
    assert counts[0] == counts[1] and len(counts[0]) > 1
    for mb in batches.flat:
        rows, length = mb["input_ids"].shape
        assert length % 16 == 0 and rows * length <= 128
    # Sorted by length, dealt across ranks in stride.
    shard_lengths = [
        [
            int((mb["input_ids"] != PAD).sum(-1)[r])
            for mb in shard
            for r in range(len(mb["input_ids"]))
        ]
        for shard in batches.shards
    ]
    assert shard_lengths[0] == sorted(lengths)[0::2]
    assert shard_lengths[1] == sorted(lengths)[1::2]


@pytest.mark.parametrize("mode", ["rows", "packing", "dynamic"])
def test_per_sequence_results_come_back_and_land_on_their_positions(mode):
    settings = _settings(mode)
    sequences = _sequences([9, 20, 33, 17, 4, 41, 5, 26])

    def per_position(mbs):  # each position's value: its token id
        return [mb["input_ids"].astype(np.float32) for mb in mbs]

    forward = packing.forward_batches(sequences, settings, pad_id=PAD)
    results = forward.per_sequence(per_position(forward.flat))
    for seq, result in zip(sequences, results, strict=True):
        assert result[: len(seq.ids)].tolist() == seq.ids
    train = packing.training_batches(sequences, settings, 2, pad_id=PAD)
    train.attach("x", results)
    train.attach("total", [np.float32(i) for i in range(len(sequences))])
    for mb in train.flat:
        mask = mb["loss_mask"] > 0
        np.testing.assert_array_equal(mb["x"][mask], mb["input_ids"][mask])
        if mode == "packing":  # a scalar spreads over its sequence's positions
            segments = mb["segment_ids"][mask]
            assert mb["total"][mask].shape == segments.shape
    with pytest.raises(ValueError, match="values for"):
        train.attach("x", results[:-1])


def test_a_tuple_result_with_an_absent_member_comes_back_per_sequence():
    settings = _settings("packing")
    sequences = _sequences([9, 20, 33])
    forward = packing.forward_batches(sequences, settings, pad_id=PAD)
    outputs = [(mb["input_ids"][..., None].repeat(2, -1), None) for mb in forward.flat]
    results = forward.per_sequence(outputs)
    assert [r[0].shape for r in results] == [(9, 2), (20, 2), (33, 2)] and results[0][1] is None


# ------------------------------------------------------------------------------- validation
def _check(overrides: dict, recipe: str = "examples/configs/grpo_math_1B_megatron_fgo.yaml"):
    import copy

    from nemo_rl_offload.config.loader import load_recipe
    from nemo_rl_offload.preflight import check_recipe

    loaded = copy.deepcopy(load_recipe(recipe))
    # The rules are checked from a recipe that batches neither way (the FGO exemplar packs).
    loaded["policy"].pop("sequence_packing", None)
    for dotted, value in overrides.items():
        node = loaded
        *parents, last = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return check_recipe(loaded, megatron_crosscheck=False)


PACKED = {"enabled": True, "train_mb_tokens": 8192, "logprob_mb_tokens": 8192}


def test_validate_accepts_packing_with_fine_grained_offloading():
    pytest.importorskip("megatron.core")
    report = _check({"policy.sequence_packing": PACKED})
    assert report.errors == []
    assert not any("sequence_packing" in line for line in report.warnings)
    (section,) = [s for s in report.sections if s.where == "policy"]
    buckets, source = section.offload["offload_sequence_length_buckets"]
    assert buckets == [8192] and "sequence_packing.train_mb_tokens" in source


def test_validate_warns_of_a_pack_shorter_than_the_longest_sequence():
    # As NeMo-RL: only a sequence that is actually longer than the pack fails, when it comes.
    pytest.importorskip("megatron.core")
    report = _check({"policy.sequence_packing": {**PACKED, "train_mb_tokens": 1000}})
    assert not [e for e in report.errors if "sequence_packing" in e], report.errors
    assert [
        w
        for w in report.warnings
        if w.startswith("warning: policy.sequence_packing.train_mb_tokens: 1000 is less than")
    ], report.warnings


def test_a_sequence_longer_than_the_pack_stops_the_run_naming_the_key():
    settings = _settings("packing")  # 104-token training packs, 128-token forward packs
    packing.training_batches(_sequences([104, 3]), settings, 1, pad_id=PAD)  # fits exactly
    with pytest.raises(UserInputError) as caught:
        packing.training_batches(_sequences([105, 3]), settings, 1, pad_id=PAD)
    assert caught.value.problems == [
        "policy.sequence_packing.train_mb_tokens: a 105-token sequence does not fit a 104-token "
        "pack; set train_mb_tokens to at least 105 (or max_total_sequence_length, to hold any "
        "sequence)"
    ]
    with pytest.raises(UserInputError, match=r"^policy\.sequence_packing\.logprob_mb_tokens"):
        packing.forward_batches(_sequences([129]), settings, pad_id=PAD)


@pytest.mark.parametrize(
    ("overrides", "line"),
    [
        (
            {
                "policy.sequence_packing": PACKED,
                "policy.dynamic_batching": {"enabled": True},
            },
            "policy.sequence_packing: cannot be enabled together with policy.dynamic_batching",
        ),
        (
            {"policy.sequence_packing": {**PACKED, "algorithm": "best_fit"}},
            "policy.sequence_packing.algorithm: unknown packing algorithm 'best_fit'",
        ),
        (
            {
                "policy.dynamic_batching": {
                    "enabled": True,
                    "logprob_mb_tokens": 4000,
                    "sequence_length_round": 64,
                }
            },
            "policy.dynamic_batching.logprob_mb_tokens: 4000 cannot hold a sequence",
        ),
        (
            {
                "policy.sequence_packing": PACKED,
                "policy.megatron_cfg.cuda_graph_impl": "full_iteration",
            },
            "policy.sequence_packing: cannot run with full_iteration CUDA graphs",
        ),
        (
            {
                "policy.dynamic_batching": {"enabled": True},
                "policy.megatron_cfg.pipeline_model_parallel_size": 2,
            },
            "policy.dynamic_batching: needs pipeline_model_parallel_size 1",
        ),
    ],
    ids=["both", "algorithm", "dynamic_budget", "graphs", "dynamic_pp"],
)
def test_validate_refuses_in_one_line_naming_the_key(overrides, line):
    pytest.importorskip("megatron.core")
    errors = _check(overrides).errors
    assert [e for e in errors if e.startswith(line)], errors


@pytest.mark.parametrize("key", ["sequence_packing", "dynamic_batching"])
def test_dpo_refuses_token_budgets_as_nemo_rl_does(key):
    pytest.importorskip("megatron.core")
    errors = _check({f"policy.{key}": {"enabled": True}}, "examples/configs/dpo.yaml").errors
    assert [e for e in errors if e.startswith(f"policy.{key}: not supported for DPO")], errors

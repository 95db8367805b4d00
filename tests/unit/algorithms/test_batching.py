"""Forward-only passes in their own micro-batch size (policy.logprob_batch_size), the loss
multiplier of a row (data.max_input_seq_length), and a multi-turn rollout's environment spans."""

from __future__ import annotations

import numpy as np
import pytest

from nemo_rl_offload.algorithms import batching
from nemo_rl_offload.algorithms.batching import TokenSequence

PAD = 0


def seqs(lengths: list[int]) -> list[TokenSequence]:
    return [TokenSequence(list(range(1, n + 1)), 2) for n in lengths]


def positional(mbs: list[dict]) -> list[np.ndarray]:
    """A stand-in pass whose result per row depends on that row only: its ids, doubled."""
    return [2.0 * mb["input_ids"].astype(np.float32) for mb in mbs]


@pytest.mark.parametrize("rows", [1, 2, 3, 5])
def test_forward_only_results_land_on_their_rows_at_any_batch_size(rows):
    sequences = seqs([3, 7, 4, 9, 5])
    calls: list[int] = []

    def counting(mbs):
        calls.extend(len(mb["input_ids"]) for mb in mbs)
        return positional(mbs)

    train = batching.microbatches(sequences, 2, pad_id=PAD)
    batching.attach_rows(train, "x", batching.forward_only(sequences, rows, counting, pad_id=PAD))
    assert max(calls) == rows  # the pass ran in micro-batches of `rows`
    for mb in train:
        np.testing.assert_array_equal(mb["x"], 2.0 * mb["input_ids"])  # padding stays 0


def test_tuple_results_and_scalars_attach_per_row():
    sequences = seqs([3, 6, 4])
    pairs = batching.forward_only(
        sequences,
        2,
        lambda mbs: [(mb["input_ids"][..., None], None) for mb in mbs],
        pad_id=PAD,
        keep_labels=False,
    )
    train = batching.microbatches(sequences, 3, pad_id=PAD)
    batching.attach_rows(train, "values", [values for values, _ in pairs])
    assert train[0]["values"].shape == (3, 6, 1)
    assert [indices for _, indices in pairs] == [None, None, None]
    batching.attach_rows(train, "total", [np.float32(i) for i in range(3)])
    np.testing.assert_array_equal(train[0]["total"], [0.0, 1.0, 2.0])
    with pytest.raises(ValueError, match="4 rows"):
        batching.attach_rows(train, "total", [np.float32(i) for i in range(4)])


def test_a_zero_loss_multiplier_masks_its_row_only():
    kept, cut = TokenSequence([1, 2, 3, 4], 2), TokenSequence([1, 2, 3, 4], 2, loss_multiplier=0.0)
    mb = batching.make_microbatch([kept, cut], pad_id=PAD)
    np.testing.assert_array_equal(mb["loss_mask"], [[0, 1, 1, 0], [0, 0, 0, 0]])


def test_a_multi_turn_rollouts_environment_spans_never_train():
    """Prompt [0, 3), the policy's turn [3, 5), a tool result [5, 8), the policy again [8, 10):
    only labels that are the policy's tokens count (position t holds token t+1)."""
    rollout = TokenSequence(list(range(1, 11)), 3, env_spans=((5, 8),), loss_multiplier=0.5)
    mask = rollout.label_mask()
    np.testing.assert_array_equal(mask, [0, 0, 0.5, 0.5, 0, 0, 0, 0.5, 0.5])
    mb = batching.make_microbatch([rollout, TokenSequence([1, 2, 3, 4], 2)], pad_id=PAD)
    np.testing.assert_array_equal(mb["loss_mask"][0, :9], mask)
    assert mb["loss_mask"][0, 9] == 0
    np.testing.assert_array_equal(mb["loss_mask"][1], [0, 1, 1, 0, 0, 0, 0, 0, 0, 0])
    # without spans, the same as a single-turn sequence
    single = TokenSequence(list(range(1, 11)), 3)
    np.testing.assert_array_equal(single.label_mask(), [0, 0, 1, 1, 1, 1, 1, 1, 1])

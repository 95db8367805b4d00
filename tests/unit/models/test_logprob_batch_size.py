"""policy.logprob_batch_size only regroups rows: a real tiny model's per-token log-probabilities,
computed in micro-batches of 1, 3 or 8 rows (batching.forward_only) and put back on training
micro-batches of another size (batching.attach_rows), equal those of one pass over every row
up to float rounding, at every counted position."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nemo_rl_offload.algorithms import batching
from nemo_rl_offload.algorithms.batching import TokenSequence

PAD = 0


def sequences() -> list[TokenSequence]:
    rng = np.random.default_rng(3)
    return [
        TokenSequence(rng.integers(1, 200, size=int(n)).tolist(), 3)
        for n in rng.integers(6, 20, size=8)
    ]


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_logprobs_do_not_depend_on_the_forward_batch_size(build_tiny, rows):
    model, _ = build_tiny("tiny-dense", seed=1)
    model.eval()

    def token_logprobs(mbs: list[dict]) -> list[np.ndarray]:
        out = []
        with torch.no_grad():
            for mb in mbs:
                ids = torch.as_tensor(mb["input_ids"])
                positions = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
                loss = model(ids, positions, None, labels=torch.as_tensor(mb["labels"]))
                out.append((-loss).float().numpy())
        return out

    seqs = sequences()
    train_mbs = batching.microbatches(seqs, 2, pad_id=PAD, round_to=4)
    batching.attach_rows(
        train_mbs, "old_logprobs", batching.forward_only(seqs, rows, token_logprobs, pad_id=PAD)
    )
    whole = batching.microbatches(seqs, len(seqs), pad_id=PAD)
    (expected,) = token_logprobs(whole)
    got = [row for mb in train_mbs for row in mb["old_logprobs"]]
    masks = [row for mb in train_mbs for row in mb["loss_mask"]]
    for index, (seq, row, mask) in enumerate(zip(seqs, got, masks, strict=True)):
        counted = np.flatnonzero(mask > 0)
        assert len(counted) == len(seq.ids) - seq.prompt_len
        np.testing.assert_allclose(row[counted], expected[index][counted], rtol=1e-5, atol=1e-5)

"""The batch split check: whole micro-batches per data-parallel rank, or equal shards with
token budgets; a bad split is one line naming the key."""

import pytest

from nemo_rl_offload.config.batch_checks import check_batch_sizes, check_split
from nemo_rl_offload.config.batching_settings import BatchingSettings
from nemo_rl_offload.distributed.sharding import split
from nemo_rl_offload.errors import UserInputError


def test_global_batch_of_whole_microbatches_per_rank_passes() -> None:
    check_batch_sizes(8, BatchingSettings.from_policy({"train_micro_batch_size": 2}), 2)


def test_global_batch_that_leaves_a_partial_microbatch_names_the_key() -> None:
    with pytest.raises(UserInputError, match=r"policy.train_global_batch_size: .* multiple of 4"):
        check_batch_sizes(6, BatchingSettings.from_policy({"train_micro_batch_size": 2}), 2)


def test_token_budgets_need_only_equal_shards() -> None:
    policy = BatchingSettings.from_policy(
        {"train_micro_batch_size": 4, "sequence_packing": {"enabled": True}}
    )
    check_split(6, policy, 2, key="grpo.num_prompts_per_step", what="6 prompts")
    with pytest.raises(UserInputError, match="grpo.num_prompts_per_step"):
        check_split(5, policy, 2, key="grpo.num_prompts_per_step", what="5 prompts")


def test_split_is_contiguous_and_balanced() -> None:
    assert split(list(range(5)), 2) == [[0, 1, 2], [3, 4]]
    assert split([], 3) == [[], [], []]

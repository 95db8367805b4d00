"""The KV-cached sampler against a full forward over each finished sequence: greedy tokens and
per-token log-probabilities equal those read from one pass over prompt + response (the logits
at each position), for right-padded prompts of different lengths, rows that stop mid-way, a
dense and an MoE model."""

from __future__ import annotations

import pytest
import torch

from nemo_rl_offload.config.generation_settings import GenerationSettings
from nemo_rl_offload.models.cached_forward import CachedForward
from nemo_rl_offload.policy.decode_graphs import windows
from nemo_rl_offload.policy.generation import (
    EngineSettings,
    SamplingSettings,
    rows_per_chunk,
    sample,
)

PROMPTS = [[5, 17, 3, 9, 40, 41, 7], [8, 2], [30, 31, 32], [11]]
CPU = torch.device("cpu")


def _reference(model, prompt: list[int], response: list[int]) -> tuple[list[int], torch.Tensor]:
    """Greedy choices and log-probabilities of ``response`` read from one forward over the
    whole sequence."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids, torch.arange(ids.shape[1]).unsqueeze(0), None)[0].float()
    at = logits[len(prompt) - 1 : len(prompt) - 1 + len(response)]
    logprobs = torch.log_softmax(at, dim=-1).gather(-1, torch.tensor(response)[:, None])[:, 0]
    return at.argmax(dim=-1).tolist(), logprobs


def _greedy(model, stops: tuple[int, ...] = ()) -> list:
    settings = SamplingSettings(max_new_tokens=9, greedy=True, stop_token_ids=stops)
    return sample(
        model, PROMPTS, settings, pad_id=0, vocab_size=model.vocab_size, seed=1, device=CPU
    )


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
def test_greedy_tokens_and_logprobs_equal_a_full_forward(build_tiny, moe_globals_restored, preset):
    model, _ = build_tiny(preset)
    model.eval()
    free = _greedy(model)
    # A stop token that one row hits mid-way (its third token) and the others may not.
    stop = free[1].ids[2]
    generated = _greedy(model, stops=(stop,))
    assert generated[1].ids == free[1].ids[:3]
    assert any(len(g.ids) == 9 for g in generated)  # the other rows keep going
    for prompt, g in zip(PROMPTS, generated, strict=True):
        tokens, logprobs = _reference(model, prompt, g.ids)
        assert g.ids == tokens
        torch.testing.assert_close(torch.tensor(g.logprobs), logprobs, atol=2e-5, rtol=0)
        if stop in g.ids:
            assert g.ids.index(stop) == len(g.ids) - 1


def test_the_same_seed_draws_the_same_samples(build_tiny):
    model, _ = build_tiny("tiny-dense")
    settings = SamplingSettings(max_new_tokens=8, temperature=0.9, top_p=0.95)

    def draw(seed: int) -> list[list[int]]:
        out = sample(
            model, PROMPTS, settings, pad_id=0, vocab_size=model.vocab_size, seed=seed, device=CPU
        )
        return [g.ids for g in out]

    assert draw(4) == draw(4)
    assert draw(4) != draw(5)


def _one_row_of_cache_gib(model, max_new_tokens: int) -> float:
    from nemo_rl_offload.policy.generation import _cache_bytes

    longest = max(len(p) for p in PROMPTS)
    return _cache_bytes(CachedForward(model, model.vocab_size), 1, longest + max_new_tokens) / 2**30


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
def test_prompts_whose_cache_does_not_fit_are_sampled_in_chunks_that_fit(
    build_tiny, moe_globals_restored, preset
):
    """A buffer of two rows' cache: the four prompts go in two chunks, with the greedy tokens
    and log-probabilities of one call over all of them (a full forward's, as above), and a
    seeded draw is reproducible."""
    model, _ = build_tiny(preset)
    model.eval()
    whole = _greedy(model)
    two_rows = EngineSettings(buffer_size_gb=2.5 * _one_row_of_cache_gib(model, 9))
    settings = SamplingSettings(max_new_tokens=9, greedy=True)
    longest = max(len(p) for p in PROMPTS) + 9
    forward = CachedForward(model, model.vocab_size)
    assert rows_per_chunk(forward, len(PROMPTS), longest, two_rows, CPU) == 2
    chunked = sample(
        model,
        PROMPTS,
        settings,
        pad_id=0,
        vocab_size=model.vocab_size,
        seed=1,
        device=CPU,
        engine=two_rows,
    )
    assert [g.ids for g in chunked] == [g.ids for g in whole]
    for a, b in zip(chunked, whole, strict=True):
        torch.testing.assert_close(
            torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=2e-5, rtol=0
        )
    drawn = SamplingSettings(max_new_tokens=6, temperature=0.9)

    def draw() -> list[list[int]]:
        out = sample(
            model,
            PROMPTS,
            drawn,
            pad_id=0,
            vocab_size=model.vocab_size,
            seed=3,
            device=CPU,
            engine=two_rows,
        )
        return [g.ids for g in out]

    assert draw() == draw() and len(draw()) == len(PROMPTS)


def test_a_cache_over_the_recipe_buffer_is_refused_in_one_line(build_tiny):
    from nemo_rl_offload.errors import UserInputError

    model, _ = build_tiny("tiny-dense")
    with pytest.raises(UserInputError, match=r"mcore_generation_config\.buffer_size_gb"):
        sample(
            model,
            PROMPTS,
            SamplingSettings(max_new_tokens=4),
            pad_id=0,
            vocab_size=model.vocab_size,
            seed=1,
            device=CPU,
            engine=EngineSettings(buffer_size_gb=1e-9),  # under one row's cache
        )


def test_engine_settings_follow_nemo_rl_keys():
    def engine(generation: dict) -> EngineSettings:
        return GenerationSettings.from_section({"generation": generation}).engine

    on = engine({"mcore_generation_config": {"cuda_graph_impl": "local", "num_cuda_graphs": 3}})
    assert on.cuda_graphs and on.num_cuda_graphs == 3
    assert not engine(
        {"mcore_generation_config": {"cuda_graph_impl": "none", "num_cuda_graphs": 3}}
    ).cuda_graphs
    assert not engine({}).cuda_graphs
    assert engine({"mcore_generation_config": {"buffer_size_gb": 10}}).buffer_size_gb == (
        pytest.approx(10.0)
    )


def test_graph_windows_cover_every_step_with_few_shapes():
    pick = windows(130, 1152, 4)
    chosen = {pick(n) for n in range(130, 1153)}
    assert len(chosen) == 4 and max(chosen) == 1152
    assert all(pick(n) >= n for n in range(130, 1153))
    assert windows(130, 1152, None)(200) == 200


def test_ranks_agree_on_what_the_buffer_holds_not_on_each_others_prompt_counts(tmp_path):
    """Two data-parallel ranks with 3 and 4 prompts: without a bound each samples all of its
    own in one chunk; with a buffer of 3.5 rows both take chunks of 3."""
    from support.worker_ranks import chunk_rows, run_ranks

    ranks = run_ranks(chunk_rows, 2, tmp_path, buffer_rows=3.5)
    assert [r["unbounded"] for r in ranks] == [3, 4]
    assert [r["bounded"] for r in ranks] == [3, 3]


def test_finished_rows_leave_the_batch_and_the_rest_decode_as_before(build_tiny, monkeypatch):
    """Once at most half the batch is unfinished, the unfinished rows move to a smaller batch
    (their keys and values to the front of the cache): each row's greedy tokens and
    log-probabilities are still those of a full forward over its own sequence."""
    from nemo_rl_offload.models.kv_cache import KVCache

    model, _ = build_tiny("tiny-dense")
    model.eval()
    prompts = PROMPTS + [[3, 4], [60, 61, 62, 63], [9, 9, 9], [21, 22]]
    settings = SamplingSettings(max_new_tokens=10, greedy=True)
    kwargs = {"pad_id": 0, "vocab_size": model.vocab_size, "seed": 1, "device": CPU}
    free = sample(model, prompts, settings, **kwargs)
    # Stop tokens that five of the eight rows hit at their second token or sooner.
    stops = tuple({g.ids[1] for g in free[:5]})
    sizes: list[int] = []
    keep_rows = KVCache.keep_rows

    def spy(self, kept, rows):
        sizes.append(rows)
        return keep_rows(self, kept, rows)

    monkeypatch.setattr(KVCache, "keep_rows", spy)
    settings = SamplingSettings(max_new_tokens=10, greedy=True, stop_token_ids=stops)
    generated = sample(model, prompts, settings, **kwargs)
    assert sizes and sizes[0] <= 4 and sizes == sorted(sizes, reverse=True)
    assert max(len(g.ids) for g in generated) > 2  # some rows decoded on after the move
    for prompt, g, f in zip(prompts, generated, free, strict=True):
        tokens, logprobs = _reference(model, prompt, g.ids)
        assert g.ids == tokens and g.ids == f.ids[: len(g.ids)]
        torch.testing.assert_close(torch.tensor(g.logprobs), logprobs, atol=2e-5, rtol=0)
        assert len(g.ids) == 10 or g.ids[-1] in stops


def test_batch_sizes_after_a_move_are_few():
    from nemo_rl_offload.policy.generation import _slots_for

    assert [_slots_for(n, 1) for n in (1, 2, 3, 5, 64, 65)] == [1, 2, 4, 8, 64, 128]
    assert [_slots_for(n, 2) for n in (1, 3)] == [2, 4]  # sequence parallel splits the rows

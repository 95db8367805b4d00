"""Router replay (``policy.router_replay``): the sampler records each position's experts, and the
policy's forwards replay them: training (recompute included) and the old policy's
log-probabilities; a position without a route keeps the router's own choice (CPU, float32,
the tiny MoE preset)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from support.policies import make_policy

from nemo_rl_offload.config import megatron_settings
from nemo_rl_offload.config.model_presets import architecture_for
from nemo_rl_offload.models import router_replay
from nemo_rl_offload.models.router_replay import NO_ROUTE, ROUTES_KEY
from nemo_rl_offload.policy.generation import SamplingSettings, sample
from nemo_rl_offload.policy.train_step import forward_outputs, run_microbatches

CPU = torch.device("cpu")
PROMPTS = [[5, 17, 3, 9, 40, 41, 7], [8, 2], [30, 31, 32], [11]]


@pytest.fixture
def build(megatron_cpu: None, moe_globals_restored: None):
    """build(replay=True, seed=0, **megatron_cfg) -> the tiny MoE GPTModel on CPU."""
    from nemo_rl_offload.models.builder import build_gpt_model

    def make(replay: bool = True, seed: int = 0, **megatron_cfg: Any):
        policy = make_policy("tiny-moe", **megatron_cfg)
        policy["precision"] = "float32"
        if replay:
            policy["router_replay"] = {"enabled": True}
        effective = megatron_settings.effective_settings(
            policy, architecture_for("tiny-moe"), te_installed=False
        )
        torch.manual_seed(seed)
        model, _ = build_gpt_model(effective, architecture_for("tiny-moe"), on_gpu=False)
        return model

    return make


def _own_routes(model, ids: torch.Tensor) -> torch.Tensor:
    """The routes the model's routers choose over ``ids`` [rows, s] in one full forward:
    [rows, s, layers, k]."""
    replays = router_replay.decoder_replays(model)
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    for _, replay in replays:
        replay.set_router_replay_action(RouterReplayAction.RECORD)
    with torch.no_grad():
        model(ids, torch.arange(ids.shape[1]).expand_as(ids), None)
    recorded = torch.stack([r.get_recorded_indices() for _, r in replays], dim=1)
    router_replay.disarm(model)
    rows, length = ids.shape
    return recorded.view(length, rows, *recorded.shape[1:]).transpose(0, 1)


def _random_routes(rows: int, length: int, layers: int, seed: int) -> torch.Tensor:
    """Distinct experts per token (4 experts, top-2), none of them the router's on purpose."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(rows, length, layers, 4, generator=g)
    return scores.topk(2, dim=-1).indices.to(torch.int16)


def test_replay_routers_stay_out_of_megatrons_process_wide_list(build):
    from megatron.core.transformer.moe.router_replay import RouterReplay

    before = len(RouterReplay.global_router_replay_instances)
    model = build()
    replays = router_replay.decoder_replays(model)
    assert [index for index, _ in replays] == [0, 1]  # one per MoE layer, in order
    assert len(RouterReplay.global_router_replay_instances) == before
    assert router_replay.replays_routes(model) and not router_replay.replays_routes(build(False))


def test_sampled_routes_are_the_routers_choices_at_every_fed_position(build):
    model = build()
    model.eval()
    settings = SamplingSettings(max_new_tokens=6, greedy=True)
    generated = sample(
        model, PROMPTS, settings, pad_id=0, vocab_size=384, seed=1, device=CPU, record_routes=True
    )
    for prompt, out in zip(PROMPTS, generated, strict=True):
        sequence = prompt + out.ids
        assert out.routes.shape == (len(sequence), 2, 2) and out.routes.dtype == np.int16
        own = _own_routes(model, torch.tensor([sequence]))[0]
        fed = len(sequence) - 1  # the last sampled token is never fed
        assert (out.routes[fed] == NO_ROUTE).all()
        recorded = np.sort(out.routes[:fed], axis=-1)
        assert (recorded == np.sort(own[:fed].numpy(), axis=-1)).all()
    plain = sample(model, PROMPTS, settings, pad_id=0, vocab_size=384, seed=1, device=CPU)
    assert [g.ids for g in plain] == [g.ids for g in generated] and plain[0].routes is None


def _batch(seed: int = 3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 384, (2, 16), generator=g)
    return {"input_ids": ids, "labels": ids.roll(-1, 1), "loss_mask": torch.ones(2, 16)}


def _token_loss(batch, output):
    mask = batch["loss_mask"]
    return (output * mask).sum(), mask.sum(), {}


def _grads(model, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    reports = run_microbatches(model, [batch], _token_loss, forward_only=False)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return reports[0]["loss"], grads


def test_training_replays_the_given_routes(build):
    model = build()
    batch = _batch()
    plain_loss, plain = _grads(model, batch)
    own = _own_routes(model, batch["input_ids"]).to(torch.int16)
    same_loss, same = _grads(model, {**batch, ROUTES_KEY: own})
    torch.testing.assert_close(same_loss, plain_loss)
    for name, grad in plain.items():
        torch.testing.assert_close(same[name], grad, rtol=1e-5, atol=1e-7)
    other = _random_routes(2, 16, 2, seed=9)
    other_loss, other_grads = _grads(model, {**batch, ROUTES_KEY: other})
    assert not torch.allclose(other_loss, plain_loss)
    # The router's scores still train through the replayed experts' probabilities.
    router = [n for n in other_grads if n.endswith("router.weight")]
    assert router and all(other_grads[n].abs().sum() > 0 for n in router)
    # Nothing stays armed after the step: a plain step is the plain step again.
    again_loss, _ = _grads(model, batch)
    torch.testing.assert_close(again_loss, plain_loss)


def test_a_position_without_a_route_keeps_the_routers_choice(build):
    model = build()
    batch = _batch()
    plain_loss, _ = _grads(model, batch)
    missing = torch.full((2, 16, 2, 2), NO_ROUTE, dtype=torch.int16)
    loss, _ = _grads(model, {**batch, ROUTES_KEY: missing})
    torch.testing.assert_close(loss, plain_loss)
    # Half the positions replayed, half the router's own: the replayed half decides.
    partial = _random_routes(2, 16, 2, seed=9)
    partial[:, 8:] = NO_ROUTE
    own = _own_routes(model, batch["input_ids"]).to(torch.int16)
    mixed = torch.cat([partial[:, :8], own[:, 8:]], dim=1)
    torch.testing.assert_close(
        _grads(model, {**batch, ROUTES_KEY: partial})[0],
        _grads(model, {**batch, ROUTES_KEY: mixed})[0],
    )


def test_full_recompute_replays_the_same_routes_in_the_backward(build):
    routes = _random_routes(2, 16, 2, seed=11)
    batch = {**_batch(), ROUTES_KEY: routes}
    stored_loss, stored = _grads(build(seed=4), batch)
    recomputing = build(
        seed=4,
        activation_checkpointing=True,
        recompute_granularity="full",
        recompute_method="uniform",
        recompute_num_layers=1,
    )
    loss, grads = _grads(recomputing, batch)
    torch.testing.assert_close(loss, stored_loss)
    for name, grad in stored.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6)


def test_forward_only_passes_replay_and_keep_nothing_armed(build):
    model = build()
    batch = _batch()
    routes = _random_routes(2, 16, 2, seed=9)

    def logprobs(_batch, per_token_loss):
        return {"logprobs": -per_token_loss}

    with torch.no_grad():
        replayed = forward_outputs(model, [{**batch, ROUTES_KEY: routes}], logprobs)[0]
        plain = forward_outputs(model, [batch], logprobs)[0]
    trained, _ = _grads(model, {**batch, ROUTES_KEY: routes})
    torch.testing.assert_close(-replayed["logprobs"].sum(), trained)
    assert not torch.allclose(replayed["logprobs"], plain["logprobs"])
    assert all(r.router_replay_action is None for _, r in router_replay.decoder_replays(model))


def test_a_packed_micro_batch_replays_each_sequences_routes(build):
    """Two sequences packed in one row replay the routes each has when run alone."""
    model = build()
    g = torch.Generator().manual_seed(5)
    first, second = (
        torch.randint(1, 384, (1, 10), generator=g),
        torch.randint(1, 384, (1, 6), generator=g),
    )
    routes = _random_routes(1, 16, 2, seed=13)

    def logprobs(_batch, per_token_loss):
        return {"logprobs": -per_token_loss}

    def alone(ids, part):
        mb = {"input_ids": ids, "labels": ids.roll(-1, 1), ROUTES_KEY: part}
        with torch.no_grad():
            return forward_outputs(model, [mb], logprobs)[0]["logprobs"][0, :-1]

    packed_ids = torch.cat([first, second], dim=1)
    labels = torch.cat([first.roll(-1, 1), second.roll(-1, 1)], dim=1)
    packed = {
        "input_ids": packed_ids,
        "labels": labels,
        "position_ids": torch.cat([torch.arange(10), torch.arange(6)])[None],
        "cu_seqlens": torch.tensor([0, 10, 16], dtype=torch.int32),
        ROUTES_KEY: routes,
    }
    with torch.no_grad():
        out = forward_outputs(model, [packed], logprobs)[0]["logprobs"][0]
    torch.testing.assert_close(out[:9], alone(first, routes[:, :10]))
    torch.testing.assert_close(out[10:15], alone(second, routes[:, 10:]))


TINY = "examples/configs/tiny"


def _check(recipe: str, *overrides: str):
    from pathlib import Path

    from nemo_rl_offload.preflight import load_and_check

    root = Path(__file__).resolve().parents[3]
    return load_and_check(str(root / TINY / f"{recipe}.yaml"), list(overrides))


ON = "++policy.router_replay.enabled=true"
MOE = "++policy.model_name=tiny-moe"


@pytest.mark.parametrize(
    "recipe,overrides,error,warning",
    [
        ("grpo", [MOE, ON], None, None),
        ("grpo", [MOE], None, None),
        ("grpo", [ON], None, "the model has no experts"),
        ("sft", [MOE, ON], "trains on no sequence this policy sampled", None),
        ("dpo", [MOE, ON], "trains on no sequence this policy sampled", None),
        (
            "grpo",
            [MOE, ON, "++policy.megatron_cfg.moe_router_load_balancing_type=sinkhorn"],
            "assigns experts without the top-k",
            None,
        ),
        (
            "grpo",
            [MOE, ON, "++policy.megatron_cfg.model_overrides.moe_router_fusion=true"],
            "fused top-k kernel does not replay",
            None,
        ),
        (
            "grpo",
            [MOE, ON, "++policy.megatron_cfg.cuda_graph_impl=full_iteration"],
            "a captured training graph would replay the routes",
            None,
        ),
    ],
    ids=["grpo", "off", "dense", "sft", "dpo", "sinkhorn", "fused", "graphs"],
)
def test_router_replay_rules(recipe, overrides, error, warning):
    report = _check(recipe, *overrides)
    replay_errors = [e for e in report.errors if "router_replay" in e]
    replay_warnings = [w for w in report.warnings if "router_replay" in w]
    if error is None:
        assert not replay_errors, replay_errors
    else:
        assert len(replay_errors) == 1 and error in replay_errors[0], report.errors
    if warning is None:
        assert not replay_warnings, replay_warnings
    else:
        assert len(replay_warnings) == 1 and warning in replay_warnings[0], report.warnings


def test_a_teachers_router_replay_is_inert():
    report = _check("distillation", "++teacher.router_replay.enabled=true")
    assert report.ok and not [e for e in report.errors if "router_replay" in e], report.errors


def _sequence(ids: list[int], prompt: int, routes: np.ndarray | None):
    from nemo_rl_offload.algorithms.batching import TokenSequence

    return TokenSequence(ids, prompt, routes=routes)


def test_batches_carry_routes_at_their_positions_and_none_elsewhere():
    from nemo_rl_offload.algorithms.batching import make_microbatch
    from nemo_rl_offload.algorithms.packing import pack_microbatch

    routes = np.arange(5 * 2 * 2, dtype=np.int16).reshape(5, 2, 2)
    with_routes = _sequence([1, 2, 3, 4, 5], 2, routes)
    without = _sequence([6, 7, 8], 1, None)
    rows = make_microbatch([with_routes, without], pad_id=0, round_to=8)[ROUTES_KEY]
    assert rows.shape == (2, 8, 2, 2) and rows.dtype == np.int16
    assert (rows[0, :5] == routes).all() and (rows[0, 5:] == NO_ROUTE).all()
    assert (rows[1] == NO_ROUTE).all()
    packed = pack_microbatch([without, with_routes], pad_id=0, length=10)[ROUTES_KEY]
    assert packed.shape == (1, 10, 2, 2)
    assert (packed[0, :3] == NO_ROUTE).all() and (packed[0, 3:8] == routes).all()
    assert (packed[0, 8:] == NO_ROUTE).all()
    assert ROUTES_KEY not in make_microbatch([without], pad_id=0)


def test_waiting_rollouts_keep_their_routes_through_a_checkpoint():
    import json

    from nemo_rl_offload.algorithms import async_rollouts
    from nemo_rl_offload.algorithms.grpo import PromptGroup

    routes = [np.arange(24, dtype=np.int16).reshape(6, 2, 2) - 3, None]
    group = PromptGroup(
        _sequence([1, 2, 3], 3, None),
        [[4, 5, 6], [7]],
        torch.tensor([1.0, 0.0]),
        torch.tensor([1.0, 0.0]),
        [False, True],
        [[-0.5, -0.25, -1.0], [-2.0]],
        routes[:1] + [np.full((4, 2, 2), NO_ROUTE, np.int16)],
    )
    pipeline = async_rollouts.RolloutPipeline(
        1,
        lambda target: ([group], {}),
        exhausted=lambda: False,
        last_step=3,
        pending=[async_rollouts.Rollouts(2, 1, [group], {"reward": 0.5})],
    )
    state = json.loads(json.dumps(pipeline.state()))
    (restored,) = async_rollouts.RolloutPipeline.restored(state, PromptGroup)
    (back,) = restored.groups
    assert len(back.routes) == 2
    for got, expected in zip(back.routes, group.routes, strict=True):
        assert got.dtype == expected.dtype and (got == expected).all()


def test_the_offload_runtimes_bucket_padding_adds_positions_without_routes():
    from nemo_rl_offload.offload.runtime import pad_microbatches

    routes = np.zeros((2, 5, 2, 2), np.int16)
    (grown,) = pad_microbatches([{"input_ids": np.ones((2, 5), np.int64), ROUTES_KEY: routes}], 8)
    assert grown[ROUTES_KEY].shape == (2, 8, 2, 2) and grown[ROUTES_KEY].dtype == np.int16
    assert (grown[ROUTES_KEY][:, :5] == 0).all() and (grown[ROUTES_KEY][:, 5:] == NO_ROUTE).all()


def test_a_training_step_reports_the_share_of_routes_replay_changed(build):
    model = build()
    batch = _batch()

    def changed(routes):
        router_replay.start_step(model, CPU)
        run_microbatches(model, [{**batch, ROUTES_KEY: routes}], _token_loss, forward_only=False)
        return router_replay.step_metrics(model, CPU)

    own = _own_routes(model, batch["input_ids"]).to(torch.int16)
    assert changed(own) == {"router_replay_changed": 0.0}
    other = _random_routes(2, 16, 2, seed=9)
    share = changed(other)["router_replay_changed"]
    own_sets, other_sets = own.sort(-1).values, other.sort(-1).values
    assert share == pytest.approx(float((own_sets != other_sets).any(-1).float().mean()))
    # Positions without a route are not replayed: they count in neither number.
    half = other.clone()
    half[:, 8:] = NO_ROUTE
    expected = float((own_sets[:, :8] != other_sets[:, :8]).any(-1).float().mean())
    assert changed(half)["router_replay_changed"] == pytest.approx(expected)
    # Outside a training step nothing is counted.
    with torch.no_grad():
        forward_outputs(model, [{**batch, ROUTES_KEY: other}], lambda b, o: {"o": o})
    assert all(r.counts is None for _, r in router_replay.decoder_replays(model))
    assert router_replay.step_metrics(build(False), CPU) == {}


def test_the_routed_share_counts_fed_positions_and_prints_nothing(capsys):
    """GRPO's ``router_replay_routed``: every position but each sequence's last (never fed) with
    a route counts; None without routes; nothing on the console (a step calls it every time)."""
    from nemo_rl_offload.algorithms.grpo import routed_share

    full = np.zeros((5, 2, 2), np.int16)
    full[-1] = NO_ROUTE  # the last sampled token: no forward fed it
    gap = full.copy()
    gap[1] = NO_ROUTE
    assert routed_share([_sequence([1] * 5, 2, full)]) == 1.0
    assert routed_share([_sequence([1] * 5, 2, full), _sequence([1] * 5, 2, gap)]) == 7 / 8
    assert routed_share([_sequence([1, 2], 1, None)]) is None
    assert capsys.readouterr() == ("", "")

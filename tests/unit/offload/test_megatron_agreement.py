"""Our offload rules agree with the installed megatron-core's own TransformerConfig checks.

For every rule case (tests/unit/offload/test_rules.py), the effective settings are applied to a
real TransformerConfig. What Megatron rejects, our rules reject (with a clearer message); what our
rules accept, Megatron accepts. Our rules are stricter in a few places on purpose (they reject
what Megatron accepts but cannot work, e.g. expert offload on a dense model); those are listed in
STRICTER_BY_DESIGN, and every other rejected case must be rejected by Megatron too.
"""

from __future__ import annotations

import pytest
from support.offload_cases import ACCEPTED, REJECTED
from support.policies import make_policy

from nemo_rl_offload.config import megatron_settings
from nemo_rl_offload.config.model_presets import architecture_for
from nemo_rl_offload.models.transformer_config import build_transformer_config
from nemo_rl_offload.preflight import check_policy

pytest.importorskip("megatron.core")

# Rejected by us, accepted by megatron-core 0.19 (the reason is in each rule's message).
STRICTER_BY_DESIGN = {
    "backend_off",  # Megatron does not know NeMo-RL's backend switch
    "dtensor_backend",
    "modules_unset",  # Megatron asserts too, but our default list is [] -> same as empty
    "expert_on_dense",  # Megatron accepts and offloads nothing
    "moe_act_on_dense",
    "expert_sequential_mlp",  # SequentialMLP offloads nothing
    "expert_no_grouped_gemm_te",
    "te_graphs_without_te",  # TE missing is found at run time by Megatron
    "te_impl_without_te",
    "nvte_env_wrong",  # an environment variable, not a TransformerConfig field
    "override_conflict",  # the recipe's own consistency
    "host_budget_zero",  # runtime settings, not TransformerConfig fields
    "buckets_empty",
    "buckets_not_positive",
    "buckets_unsorted",
    "buckets_too_short",
    "override_named_recompute",
    "override_transformer_impl",
    "override_unknown_field",  # Megatron raises TypeError: also a rejection, checked below
    "inflight_negative",  # Megatron checks it only under full_iteration graphs
    "full_iteration_moe",  # capture fails at run time (host sync in the token dispatch)
    "full_iteration_moe_capacity_without_padding",  # dropping alone still syncs
    "full_iteration_moe_allgather",  # the allgather dispatcher syncs always
    # This package's dense-MLP offload modules never reach TransformerConfig
    # (config.megatron_settings).
    "mlp_on_moe",
    "mlp_with_te_spec",
    "mlp_with_full_iteration_graphs",
    "mlp_with_full_recompute",
    "mlp_with_mlp_recompute",
    # Selective recompute on the local spec (models.local_recompute): mlp_act never reaches
    # TransformerConfig; Megatron skips mlp on MoE layers and accepts the rest as given.
    "mlp_act_recompute_on_moe",
    "mlp_recompute_on_moe",
    "mlp_act_with_mlp_recompute",
    "mlp_act_recompute_with_te_spec",
    "local_recompute_with_graphs",
    "layernorm_recompute_with_qkv_offload",
    "mlp_act_recompute_with_mlp_fc2_offload",
}


def _megatron_verdict(model, settings) -> str | None:
    """None when megatron-core accepts the settings, else its error message."""
    policy = make_policy(model, **settings)
    effective = megatron_settings.effective_settings(
        policy, architecture_for(model), where="policy", te_installed=False
    )
    try:
        build_transformer_config(effective)
    except Exception as exc:  # AssertionError, ValueError, TypeError: all are rejections
        return f"{type(exc).__name__}: {exc}"
    return None


def _our_errors(model, caps, settings) -> list[str]:
    return check_policy(
        make_policy(model, **settings),
        where="policy",
        architecture=architecture_for(model),
        caps=caps,
        gpus_per_node=1,
    ).errors


@pytest.mark.parametrize(
    "case_id,model,caps,settings",
    [(case[0], *case[1:4]) for case in REJECTED + ACCEPTED],
    ids=[case[0] for case in REJECTED + ACCEPTED],
)
def test_megatron_rejections_are_ours_first(case_id, model, caps, settings):
    megatron_error = _megatron_verdict(model, settings)
    ours = _our_errors(model, caps, settings)
    if megatron_error is not None:
        assert ours, f"megatron-core rejects but our rules accept: {megatron_error}"
    if not ours:
        assert megatron_error is None, f"we accept but megatron-core rejects: {megatron_error}"


@pytest.mark.parametrize(
    "case_id,model,settings",
    [(c[0], c[1], c[3]) for c in REJECTED if c[0] not in STRICTER_BY_DESIGN],
    ids=[c[0] for c in REJECTED if c[0] not in STRICTER_BY_DESIGN],
)
def test_shared_rules_are_megatron_rules(case_id, model, settings):
    """Every rejected case not stricter by design is a rule megatron-core has too."""
    assert _megatron_verdict(model, settings) is not None


def test_stricter_list_is_current():
    """A stricter-by-design case that Megatron starts rejecting should move out of the list."""
    by_id = {case[0]: case for case in REJECTED}
    now_rejected = [
        case_id
        for case_id in sorted(STRICTER_BY_DESIGN - {"override_unknown_field", "modules_unset"})
        if _megatron_verdict(by_id[case_id][1], by_id[case_id][3]) is not None
    ]
    assert now_rejected == [], f"megatron-core now rejects these too: {now_rejected}"

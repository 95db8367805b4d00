"""One rule for "the model has experts": more than one expert, from the effective settings."""

from nemo_rl_offload.config.megatron_settings import effective_settings
from nemo_rl_offload.config.model_presets import PRESETS, has_experts


def test_more_than_one_expert_has_experts_and_one_or_none_does_not() -> None:
    assert has_experts(4)
    assert not has_experts(1)  # one expert is a dense MLP
    assert not has_experts(None) and not has_experts(True) and not has_experts("8")


def test_the_effective_settings_read_the_presets_experts_and_model_overrides() -> None:
    def is_moe(model: str, **overrides: object) -> bool:
        section = {"model_name": model, "megatron_cfg": {"model_overrides": overrides}}
        return effective_settings(section, PRESETS[model], te_installed=False).is_moe

    assert is_moe("tiny-moe") and not is_moe("tiny-dense")
    assert not is_moe("tiny-moe", num_moe_experts=1)

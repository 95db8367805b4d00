"""LoRA adapters (policy.megatron_cfg.peft): placed on the chosen linears, zero B gives the
base model exactly, training moves only the adapters (plain and distributed optimizer) and
resumes bitwise, and the merged weights compute what the adapted model does."""

from __future__ import annotations

import pytest
import torch
from support import worker_ranks
from support.worker_ranks import section

from nemo_rl_offload.models import lora

PEFT = {"enabled": True, "dim": 4, "alpha": 8, "dropout": 0.0}
IDS = torch.tensor([[5, 17, 3, 9, 41, 2, 8, 30]])
POSITIONS = torch.arange(IDS.shape[1])[None]


def _logits(model) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(IDS, POSITIONS, attention_mask=None)


def test_zero_b_gives_the_base_model_and_only_adapters_train(build_tiny):
    base, _ = build_tiny("tiny-dense", seed=3)
    adapted, _ = build_tiny("tiny-dense", seed=3, peft={**PEFT, "exclude_modules": ["*fc2"]})
    placed = {linear.lora_name for _, linear in lora.adapted_linears(adapted)}
    assert placed == {"linear_qkv", "linear_proj", "linear_fc1"}
    trainable = [n for n, p in adapted.named_parameters() if p.requires_grad]
    assert trainable and all(lora.is_adapter_key(n) for n in trainable)
    assert all(p.requires_grad for p in base.parameters())
    assert torch.equal(_logits(adapted), _logits(base))
    # A non-zero B changes the outputs: the adapters are on the forward path.
    for _, linear in lora.adapted_linears(adapted):
        torch.nn.init.normal_(linear.lora_b, std=0.1)
    assert not torch.allclose(_logits(adapted), _logits(base))


def test_merged_weights_compute_what_the_adapted_model_does(build_tiny):
    adapted, _ = build_tiny("tiny-dense", seed=4, peft=PEFT)
    for _, linear in lora.adapted_linears(adapted):
        torch.nn.init.normal_(linear.lora_b, std=0.1)
    plain, _ = build_tiny("tiny-dense", seed=5)
    plain.load_state_dict(lora.merged_state_dict(adapted))
    torch.testing.assert_close(_logits(plain), _logits(adapted), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("distributed", [False, True], ids=["plain", "distributed"])
def test_training_moves_only_adapters_and_resumes_bitwise(megatron_cpu, tmp_path, distributed):

    policy = section(optimizer={"use_distributed_optimizer": distributed}, peft=PEFT)

    trained = worker_ranks.single_worker(policy)
    weights = trained._unwrapped().state_dict()
    before = {k: v.clone() for k, v in weights.items() if torch.is_tensor(v)}
    batch = worker_ranks.step_batches(1)
    losses = [trained.train(batch, worker_ranks.LOSS)["loss"] for _ in range(4)]
    assert losses == sorted(losses, reverse=True) and losses[-1] < losses[0]
    after = trained._unwrapped().state_dict()
    for key, value in before.items():
        assert torch.equal(after[key], value) != lora.is_adapter_key(key), key
    resumed = worker_ranks.resumes_exactly(trained, policy, tmp_path / "ckpt", (5, 6))
    for made in (trained, resumed):
        made.close()

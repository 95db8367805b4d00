"""The GPU tests' one-rank Megatron: torch.distributed (nccl) and Megatron's parallel groups, all
sizes 1, for tests that build models directly (a test module imports the fixture by name)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(scope="module")
def megatron_gpu(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    import torch.distributed as dist

    from nemo_rl_offload.models.cpu_compat import cpu_execution_enabled
    from nemo_rl_offload.models.parallel import (
        destroy_megatron_parallel,
        initialize_megatron_parallel,
    )

    torch.cuda.set_device(0)
    # A policy worker of an earlier GPU test in this process may have started torch.distributed
    # (nccl, one rank) and Megatron's groups (all sizes 1): both are what these tests need.
    owned = not dist.is_initialized()
    if owned:
        store = dist.FileStore(str(tmp_path_factory.mktemp("dist") / "store"), 1)
        dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    try:
        initialize_megatron_parallel({}, seed=1234, on_gpu=True)
        assert not cpu_execution_enabled()
        yield
    finally:
        if owned:
            destroy_megatron_parallel()
            dist.destroy_process_group()

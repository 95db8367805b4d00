"""Hugging Face checkpoint directories on disk: sharded writing and reading, the one-line errors
for broken directories, and joining pipeline stages (no model needed)."""

from __future__ import annotations

import json

import pytest
import torch

from nemo_rl_offload.errors import UserInputError
from nemo_rl_offload.models.hf_checkpoint import (
    INDEX_FILE,
    merge_pipeline_stages,
    read_hf_weights,
    write_hf_checkpoint,
)


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        f"model.layers.{i}.mlp.up_proj.weight": torch.randn(64, 32, generator=g) for i in range(4)
    }


def test_sharded_write_reads_back_bitwise_and_headers_give_shapes(tmp_path):
    state = _state()
    files = write_hf_checkpoint(
        state, {"model_type": "llama"}, tmp_path / "out", max_shard_bytes=9000
    )
    assert INDEX_FILE in files and sum(f.endswith(".safetensors") for f in files) == 4
    back = read_hf_weights(tmp_path / "out")
    assert back.keys() == state.keys()
    assert all(torch.equal(back[k], state[k]) for k in state)
    meta = read_hf_weights(tmp_path / "out", meta=True)
    assert {k: (tuple(v.shape), v.device.type) for k, v in meta.items()} == {
        k: ((64, 32), "meta") for k in state
    }


def test_a_missing_shard_is_named_with_what_the_index_expects(tmp_path):
    write_hf_checkpoint(_state(), {}, tmp_path / "out", max_shard_bytes=9000)
    (tmp_path / "out" / "model-00002-of-00004.safetensors").unlink()
    with pytest.raises(UserInputError) as error:
        read_hf_weights(tmp_path / "out")
    (line,) = error.value.problems
    assert line == (
        f"{tmp_path / 'out' / 'model-00002-of-00004.safetensors'}: missing; "
        f"{INDEX_FILE} lists it for 1 tensors"
    )


def test_an_index_promising_a_tensor_its_shard_lacks(tmp_path):
    write_hf_checkpoint(_state(), {}, tmp_path / "out", max_shard_bytes=9000)
    index_path = tmp_path / "out" / INDEX_FILE
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.norm.weight"] = "model-00001-of-00004.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(UserInputError, match="lacks model.norm.weight, which"):
        read_hf_weights(tmp_path / "out")


def test_pickle_only_and_empty_directories_are_refused(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(UserInputError, match="only safetensors checkpoints are read"):
        read_hf_weights(tmp_path)
    with pytest.raises(UserInputError, match="holds no weights"):
        read_hf_weights(tmp_path / "nothing")


def test_export_refuses_a_non_empty_directory_and_leaves_it_alone(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(UserInputError, match="exists and is not empty"):
        write_hf_checkpoint(_state(), {}, tmp_path / "out")
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary left behind


def test_pipeline_stages_join_with_the_whole_models_layer_numbers():
    first = {
        "embedding.word_embeddings.weight": 0,
        "decoder.layers.0.x": 1,
        "decoder.layers.1.x": 2,
    }
    second = {"decoder.layers.0.x": 3, "decoder.layers.1.x": 4, "output_layer.weight": 5}
    assert merge_pipeline_stages([first, second]) == {
        "embedding.word_embeddings.weight": 0,
        "decoder.layers.0.x": 1,
        "decoder.layers.1.x": 2,
        "decoder.layers.2.x": 3,
        "decoder.layers.3.x": 4,
        "output_layer.weight": 5,
    }

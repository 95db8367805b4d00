"""Byte tokenizer behaviour, the HF wrapper's fallbacks, and tokenizer selection."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from nemo_rl_offload.config.model_presets import PRESETS
from nemo_rl_offload.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer
from nemo_rl_offload.errors import UserInputError


def test_byte_ids_and_specials() -> None:
    tok = ByteTokenizer()
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (256, 257, 258)
    assert tok.vocab_size == 384
    assert tok.name == "byte"
    assert tok.encode("A") == [65]
    assert tok.encode("A", add_bos=True, add_eos=True) == [257, 65, 258]
    assert isinstance(tok, Tokenizer)


def test_byte_vocab_matches_tiny_presets() -> None:
    for name in ("tiny-dense", "tiny-moe"):
        assert PRESETS[name].vocab_size == ByteTokenizer().vocab_size


@pytest.mark.parametrize("text", ["Q: 37+48=? A: 85", "", "héllo wörld", "数学 🚀 ∑x²"])
def test_byte_round_trip(text: str) -> None:
    tok = ByteTokenizer()
    ids = tok.encode(text, add_bos=True, add_eos=True)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_non_ascii_is_several_bytes() -> None:
    assert ByteTokenizer().encode("é") == [0xC3, 0xA9]


def test_decode_specials_shown_or_skipped() -> None:
    tok = ByteTokenizer()
    ids = [257, 104, 105, 258, 256, 300]
    assert tok.decode(ids) == "hi"
    assert tok.decode(ids, skip_special=False) == "<bos>hi<eos><pad><unused_300>"


def test_decode_invalid_utf8_is_replaced() -> None:
    tok = ByteTokenizer()
    cut = tok.encode("é")[:1] + tok.encode("x")
    assert tok.decode(cut) == "\ufffdx"
    assert tok.decode(cut[:1] + [258], skip_special=False) == "\ufffd<eos>"


def test_decode_rejects_ids_outside_vocab() -> None:
    with pytest.raises(ValueError, match="384"):
        ByteTokenizer().decode([384])


class _FakeHF:
    """Stands in for a transformers tokenizer: 'a'->5, 'b'->6, no pad token."""

    def __init__(self, pad: int | None, bos: int | None, eos: int | None) -> None:
        self.pad_token_id, self.bos_token_id, self.eos_token_id = pad, bos, eos

    def __len__(self) -> int:
        return 10

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert add_special_tokens is False
        return [5 if ch == "a" else 6 for ch in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return ("S" if not skip_special_tokens else "") + "".join(
            {5: "a", 6: "b"}.get(i, "") for i in ids
        )


@pytest.fixture
def fake_transformers(monkeypatch: pytest.MonkeyPatch):
    """Install a fake ``transformers`` whose AutoTokenizer returns the tokenizer in ``made``."""
    made: dict[str, object] = {}
    calls: list[tuple[str, bool]] = []

    class AutoTokenizer:
        @staticmethod
        def from_pretrained(path: str, local_files_only: bool = False):
            calls.append((path, local_files_only))
            if isinstance(made["tok"], Exception):
                raise made["tok"]
            return made["tok"]

    module = types.ModuleType("transformers")
    module.AutoTokenizer = AutoTokenizer  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "transformers", module)
    return made, calls


def test_hf_pad_falls_back_to_eos(fake_transformers, tmp_path: Path) -> None:
    made, calls = fake_transformers
    made["tok"] = _FakeHF(pad=None, bos=1, eos=2)
    tok = HFTokenizer(str(tmp_path))
    assert calls == [(str(tmp_path), True)]
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.vocab_size) == (2, 1, 2, 10)
    assert tok.encode("ab", add_bos=True, add_eos=True) == [1, 5, 6, 2]
    assert tok.decode([5, 6]) == "ab"
    assert tok.decode([5], skip_special=False) == "Sa"
    assert tok.name == str(tmp_path)
    assert isinstance(tok, Tokenizer)


def test_hf_without_bos_skips_it(fake_transformers, tmp_path: Path) -> None:
    made, _ = fake_transformers
    made["tok"] = _FakeHF(pad=0, bos=None, eos=2)
    tok = HFTokenizer(str(tmp_path))
    assert tok.pad_id == 0
    assert tok.encode("a", add_bos=True) == [5]


def test_hf_without_eos_is_a_user_error(fake_transformers, tmp_path: Path) -> None:
    made, _ = fake_transformers
    made["tok"] = _FakeHF(pad=0, bos=None, eos=None)
    with pytest.raises(UserInputError) as info:
        HFTokenizer(str(tmp_path))
    assert info.value.problems[0].startswith(f"{tmp_path}: the tokenizer defines no eos token")


def test_hf_unloadable_directory_is_one_line(fake_transformers, tmp_path: Path) -> None:
    made, _ = fake_transformers
    made["tok"] = OSError("Can't load tokenizer for 'x'.\nMore details here")
    with pytest.raises(UserInputError) as info:
        HFTokenizer(str(tmp_path))
    (line,) = info.value.problems
    assert line.startswith(f"{tmp_path}: not a loadable Hugging Face tokenizer directory")
    assert "\n" not in line and "Can't load tokenizer for 'x'." in line


def test_hf_without_transformers(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes the import fail
    with pytest.raises(UserInputError) as info:
        HFTokenizer(str(tmp_path))
    assert info.value.problems == [
        f"{tmp_path}: loading a Hugging Face tokenizer needs the transformers package; "
        "pip install transformers"
    ]


def test_load_tokenizer_choices(fake_transformers, tmp_path: Path) -> None:
    made, calls = fake_transformers
    made["tok"] = _FakeHF(pad=0, bos=1, eos=2)
    assert isinstance(load_tokenizer(None, None), ByteTokenizer)
    assert isinstance(load_tokenizer("byte", None), ByteTokenizer)
    assert isinstance(load_tokenizer("byte", str(tmp_path)), ByteTokenizer)
    assert calls == []
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    assert load_tokenizer(None, str(model_dir)).name == str(model_dir)
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    assert load_tokenizer(str(tok_dir), str(model_dir)).name == str(tok_dir)
    assert [c[0] for c in calls] == [str(model_dir), str(tok_dir)]
    # NeMo-RL's recipes write tokenizer.name: ${policy.model_name}: the model's own tokenizer.
    hub_name = "Qwen/Qwen2.5-1.5B"
    assert load_tokenizer(hub_name, str(model_dir), hub_name).name == str(model_dir)
    assert isinstance(load_tokenizer("llama-1b", None, "llama-1b"), ByteTokenizer)


@pytest.mark.parametrize("name", ["gpt2", "/no/such/dir", "a/b/c"])
def test_load_tokenizer_unknown_name(name: str) -> None:
    with pytest.raises(UserInputError) as info:
        load_tokenizer(name, None)
    (line,) = info.value.problems
    assert line.startswith(f"policy.tokenizer.name: '{name}' is neither 'byte', the policy's")
    # validate reports the same line before a run starts.
    from nemo_rl_offload.preflight import load_and_check

    tiny = Path(__file__).resolve().parents[3] / "examples" / "configs" / "tiny" / "sft.yaml"
    assert line in load_and_check(str(tiny), [f"++policy.tokenizer.name={name}"]).errors
    assert load_and_check(str(tiny), ["++policy.tokenizer.name=${policy.model_name}"]).ok


def test_a_hugging_face_tokenizer_comes_from_the_local_cache_as_a_model_does(
    fake_transformers, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NeMo-RL recipes name Hub tokenizers (an instruct model's for a base model, say): read
    from the Hugging Face cache when there; otherwise validate warns and a run refuses."""
    from nemo_rl_offload.config.model_presets import ModelNotOnMachine
    from nemo_rl_offload.preflight import load_and_check

    made, calls = fake_transformers
    made["tok"] = _FakeHF(pad=0, bos=1, eos=2)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    name = "meta-llama/Llama-3.1-8B-Instruct"
    tiny = Path(__file__).resolve().parents[3] / "examples" / "configs" / "tiny" / "sft.yaml"
    override = [f"++policy.tokenizer.name={name}"]
    with pytest.raises(ModelNotOnMachine):
        load_tokenizer(name, None, "tiny-dense")
    report = load_and_check(str(tiny), override)
    assert report.ok and any("tokenizer 'meta-llama" in w for w in report.warnings)
    assert any(
        "not on this machine" in e
        for e in load_and_check(str(tiny), override, starting=True).errors
    )
    snapshot = tmp_path / "hub" / "models--meta-llama--Llama-3.1-8B-Instruct" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    assert load_tokenizer(name, None, "tiny-dense").name == str(snapshot)
    assert calls[-1][0] == str(snapshot)
    assert not [w for w in load_and_check(str(tiny), override).warnings if "tokenizer '" in w]

"""Write a local Hugging Face model directory to start a run from, without any model hub.

The weights are random (transformers' own initialisation) and the tokenizer is character-level
over printable ASCII plus <pad>, <bos>, <eos> and <unk>: enough for the built-in arithmetic task.
Use it to try `policy.model_name: <directory>` and `nemo-rl-offload export-hf`, or as a test
fixture; a real run starts from a downloaded checkpoint directory instead.

    python examples/make_hf_model.py --out results/hf/tiny-llama
    python examples/make_hf_model.py --out results/hf/llama-1b --layers 16 --hidden 2048 \
        --heads 32 --kv-heads 8 --ffn 8192 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import string
import sys
from pathlib import Path

SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
FAMILIES = ("llama", "qwen2", "qwen3")


def char_tokenizer():
    """A transformers fast tokenizer with one id per printable ASCII character."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    characters = sorted(set(string.printable) - set("\x0b\x0c\r"))
    vocab = {token: index for index, token in enumerate((*SPECIALS, *characters))}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
    )


def make_model_dir(
    out: str | Path,
    *,
    family: str = "llama",
    layers: int = 2,
    hidden: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    ffn: int = 256,
    dtype: str = "float32",
    seed: int = 0,
    tie_embeddings: bool = False,
) -> Path:
    """Save a random ``family`` model and the character tokenizer to ``out``; returns it."""
    import torch
    import transformers

    tokenizer = char_tokenizer()
    vocab = -(-len(tokenizer) // 64) * 64  # embedding rows padded to a multiple of 64
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[family]
    torch.manual_seed(seed)
    model = model_class(config_class(**common)).to(getattr(torch, dtype))
    out = Path(out)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="a new directory")
    parser.add_argument("--family", choices=FAMILIES, default="llama")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--ffn", type=int, default=256)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tie-embeddings", action="store_true")
    args = parser.parse_args(argv)
    if Path(args.out).exists() and any(Path(args.out).iterdir()):
        print(f"--out: {args.out} exists and is not empty; give a new directory", file=sys.stderr)
        return 2
    out = make_model_dir(
        args.out,
        family=args.family,
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        kv_heads=args.kv_heads,
        ffn=args.ffn,
        dtype=args.dtype,
        seed=args.seed,
        tie_embeddings=args.tie_embeddings,
    )
    print(f"written: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

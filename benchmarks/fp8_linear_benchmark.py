"""One transformer layer's four linears, forward and backward, in bfloat16 and in FP8
(models.fp8_linear), on the GPU: where the FP8 step's time goes (the products on torch's FP8
kernels, the quantizers) and what its saved inputs weigh.

    python3 benchmarks/fp8_linear_benchmark.py --tokens 8192 --out DIR

Shapes: the 3B layer of issue 20 (hidden 3072, ffn 8192 gated, 24 heads, 8 query groups) unless
given. The quantizers run compiled on the GPU (models.fp8_math); ``--eager-too`` adds a row
with their eager form, to show what compiling them is worth."""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from nemo_rl_offload.models import fp8_linear, fp8_math
from nemo_rl_offload.models.fp8_math import Fp8Recipe


def _linears(hidden: int, ffn: int, heads: int, groups: int) -> dict[str, tuple[int, int]]:
    head = hidden // heads
    return {
        "linear_qkv": (hidden, hidden + 2 * groups * head),
        "linear_proj": (hidden, hidden),
        "linear_fc1": (hidden, 2 * ffn),
        "linear_fc2": (ffn, hidden),
    }


def _time(fn, warmup: int = 3, iters: int = 10) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=3072)
    parser.add_argument("--ffn", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=24)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--eager-too", action="store_true")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    shapes = _linears(args.hidden, args.ffn, args.heads, args.groups)
    weights = {
        name: torch.nn.Parameter(
            torch.randn(out, inp, device="cuda", dtype=torch.bfloat16) * inp**-0.5
        )
        for name, (inp, out) in shapes.items()
    }
    inputs = {
        name: torch.randn(args.tokens, inp, device="cuda", dtype=torch.bfloat16)
        for name, (inp, _) in shapes.items()
    }
    grads = {
        name: torch.randn(args.tokens, out, device="cuda", dtype=torch.bfloat16)
        for name, (_, out) in shapes.items()
    }

    def layer(product) -> float:
        def step() -> None:
            for name, w in weights.items():
                x = inputs[name].detach().requires_grad_()
                product(x, w).backward(grads[name])
                w.grad = None

        return _time(step)

    rows: dict[str, dict[str, float]] = {}
    rows["bf16"] = {"fwd_bwd_ms": layer(lambda x, w: torch.nn.functional.linear(x, w))}
    for recipe in ("blockwise", "tensorwise"):
        r = Fp8Recipe(recipe)  # type: ignore[arg-type]
        rows[f"fp8_{recipe}"] = {
            "fwd_bwd_ms": layer(
                lambda x, w, r=r: fp8_linear._Fp8LinearFunction.apply(x, w, r, "quantized")
            )
        }
        # The products alone, on operands quantized once.
        quantized = {}
        for name, w in weights.items():
            x = inputs[name]
            p2 = r.power_of_2_scales
            quantized[name] = (
                fp8_math.quantize(x, r.activation_layout, torch.float8_e4m3fn, power_of_2=p2),
                fp8_math.quantize(w.detach(), r.weight_layout, torch.float8_e4m3fn, power_of_2=p2),
            )
        kernels = all(fp8_math.kernel_for(a, b) for a, b in quantized.values())

        def products(quantized=quantized) -> None:
            for a, b in quantized.values():
                fp8_math.matmul_nt(a, b, torch.bfloat16)

        def bf16_products() -> None:
            for name, w in weights.items():
                torch.nn.functional.linear(inputs[name], w.detach())

        rows[f"fp8_{recipe}"].update(
            forward_products_ms=_time(products),
            bf16_forward_products_ms=_time(bf16_products),
            on_kernels=kernels,
        )

        def quantizers(r=r) -> None:
            for name in weights:
                fp8_math.quantize(
                    inputs[name],
                    r.activation_layout,
                    torch.float8_e4m3fn,
                    power_of_2=r.power_of_2_scales,
                )

        rows[f"fp8_{recipe}"]["forward_input_quantizers_ms"] = _time(quantizers)
    if args.eager_too:
        fp8_math._COMPILED.eager = True  # the eager quantizers, for comparison
        try:
            r = Fp8Recipe("blockwise")
            rows["fp8_blockwise_eager_quantizers"] = {
                "fwd_bwd_ms": layer(
                    lambda x, w: fp8_linear._Fp8LinearFunction.apply(x, w, r, "quantized")
                )
            }
        finally:
            fp8_math._COMPILED.eager = False
    saved_bf16 = sum(x.numel() * 2 for x in inputs.values())
    result = {
        "what": "one 3B-shaped layer's four linears, forward + backward",
        "tokens": args.tokens,
        "shapes": shapes,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
        "saved_inputs_bytes": {"bf16": saved_bf16, "fp8": saved_bf16 // 2},
        "rows": rows,
    }
    (args.out / f"fp8_linear_tokens{args.tokens}.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

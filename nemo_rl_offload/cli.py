"""``nemo-rl-offload``: the command line. Thin: parse arguments, call the package, print.

Exit codes: 0 success, 2 a mistake in what the user gave (printed as one line per problem on
stderr, never a traceback), 1 anything else.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from nemo_rl_offload import known_warnings
from nemo_rl_offload.errors import UserInputError

EXIT_USER_ERROR = 2


def _show(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_show(item) for item in value) + "]"
    if hasattr(value, "name") and not isinstance(value, str):  # enums such as CudaGraphModule
        return str(value.name)
    return str(value)


def _print_report(
    report: Any, recipe_path: str, out: TextIO, err: TextIO, estimate: Sequence[str] = ()
) -> None:
    for line in report.errors:
        print(line, file=err)
    for line in report.warnings:
        print(line if line.startswith("warning:") else f"warning: {line}", file=err)
    if not report.ok:
        return
    caps = report.caps
    print(f"recipe: {recipe_path} (algorithm: {report.algorithm})", file=out)
    print(
        f"megatron-core {caps.megatron_version or 'not installed'}, Transformer Engine "
        f"{caps.te_version or 'not installed'}",
        file=out,
    )
    for section in report.sections:
        print(
            f"{section.where}: offload settings (transformer_impl {section.transformer_impl})",
            file=out,
        )
        width = max(len(name) for name in section.offload) if section.offload else 0
        for name, (value, source) in section.offload.items():
            print(f"  {name:<{width}}  {_show(value):<24} # {source}", file=out)
    if report.worker_env:
        env = " ".join(f"{key}={value}" for key, value in sorted(report.worker_env.items()))
        print(f"worker environment: {env}", file=out)
    for note in report.notes:
        print(f"note: {note}", file=out)
    for line in estimate:
        print(line, file=out)
    print("valid", file=out)


def _cmd_validate(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from nemo_rl_offload.preflight import load_and_check

    report = load_and_check(args.config, args.overrides)
    estimate: list[str] = []
    if report.ok and not args.no_estimate:
        from pathlib import Path

        from nemo_rl_offload.planning.memory_report import memory_estimate

        found = memory_estimate(
            report.recipe,
            report.algorithm,
            gpu_memory_gib=args.gpu_memory_gib,
            base_dir=Path.cwd(),
        )
        estimate, report.warnings = found.lines, [*report.warnings, *found.warnings]
    _print_report(report, args.config, out, err, estimate)
    return 0 if report.ok else EXIT_USER_ERROR


_TRAINING_COMMANDS = (
    ("sft", "nemo_rl_offload.algorithms.sft", "run_sft", "supervised fine-tuning"),
    ("dpo", "nemo_rl_offload.algorithms.dpo", "run_dpo", "direct preference optimisation"),
    ("grpo", "nemo_rl_offload.algorithms.grpo", "run_grpo", "GRPO"),
    (
        "distill",
        "nemo_rl_offload.algorithms.distillation",
        "run_distillation",
        "on-policy distillation",
    ),
)


def _job(run: Callable[[argparse.Namespace], int]):
    """A handler for a command that starts workers: logs to stderr; a worker's failure is one
    line and exit 1."""

    def handler(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
        from nemo_rl_offload.distributed.worker_group import WorkerError
        from nemo_rl_offload.errors import ServiceError

        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=err)
        try:
            return run(args)
        except (WorkerError, ServiceError) as exc:
            print(f"error: {exc}", file=err)
            return 1

    return handler


def _training_job(module: str, function: str, algorithm: str):
    def run(args: argparse.Namespace) -> int:
        from nemo_rl_offload.planning import plan_at_start

        started = time.monotonic()  # checkpoint_must_save_by counts from the command's start
        report = plan_at_start.checked(args.config, args.overrides, algorithm)
        return getattr(importlib.import_module(module), function)(report, started=started)

    return _job(run)


def _run_telemetry(args: argparse.Namespace) -> int:
    from nemo_rl_offload import telemetry

    result = telemetry.measure(
        args.config,
        args.overrides,
        steps=args.steps,
        lengths=args.lengths,
        baseline=args.baseline,
    )
    telemetry.format_report(result, sys.stdout)
    if args.json:
        telemetry.write_json(result, args.json)
        print(f"written: {args.json}", file=sys.stderr)
    return 0


def _run_plan(args: argparse.Namespace) -> int:
    from nemo_rl_offload.planning import planner

    try:
        result = planner.plan(
            args.config,
            args.overrides,
            budgets_gib=args.budget_gib,
            budget_fractions=args.budget_fraction,
            steps=args.steps,
            max_trials=args.max_trials,
        )
    except planner.ProfileFailed as failed:
        print(f"error: {failed}", file=sys.stderr)
        return 1
    if args.json:
        from nemo_rl_offload.telemetry import write_json

        write_json(planner.as_json(result), args.json)  # its folder made, written atomically
        print(f"written: {args.json}", file=sys.stderr)
    return 0 if planner.format_plan(result, sys.stdout) else 1


def _cmd_ledger(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """``plan --ledger``: the recipe's activation ledger, measured on the CPU here (no
    workers)."""
    from pathlib import Path

    from nemo_rl_offload.planning.ledger import format_ledger
    from nemo_rl_offload.planning.ledger_run import build_ledger
    from nemo_rl_offload.preflight import load_and_check

    report = load_and_check(args.config, args.overrides)
    if report.errors:
        raise UserInputError(report.errors)
    ledger = build_ledger(report.recipe["policy"], base_dir=Path.cwd())
    format_ledger(ledger, out)
    if args.json:
        import json

        target = Path(args.json)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(ledger.as_json(), indent=1))
        print(f"written: {args.json}", file=err)
    return 0


def _cmd_plan(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    if args.ledger:
        return _cmd_ledger(args, out, err)
    return _job(_run_plan)(args, out, err)


def _comma_separated(cast: type, example: str) -> Any:
    """An argparse type: comma-separated values of ``cast``, one clear line when not."""

    def parse(text: str) -> list:
        try:
            return [cast(part) for part in text.split(",") if part.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a comma-separated list such as {example}"
            ) from None

    return parse


_numbers = _comma_separated(float, "0.9,0.75")


def _positive_number(text: str) -> float:
    """An argparse type: a number > 0, one clear line when not."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number such as 80")
    return value


_lengths = _comma_separated(int, "1024,2048")


def _cmd_export_hf(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from nemo_rl_offload.export_hf import export

    files = export(
        args.config,
        args.overrides,
        checkpoint=args.checkpoint,
        out=args.out,
        model_type=args.model_type,
    )
    print(f"written: {args.out} ({', '.join(files)})", file=out)
    return 0


def _run_serve(args: argparse.Namespace) -> int:
    from nemo_rl_offload.serving.serve import serve

    return serve(args.config, args.overrides, checkpoint=args.checkpoint)


def _run_demo(args: argparse.Namespace) -> int:
    from nemo_rl_offload.demo import run_demo

    return run_demo(args.output_dir)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nemo-rl-offload",
        description="RL post-training on Megatron-core with fine-grained activation offloading.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    validate = commands.add_parser(
        "validate",
        help="check a recipe (schema, offload rules, Megatron's checks) and print its settings",
        description="Check a recipe and print the resolved offload settings. Exit 0 when valid, "
        "2 with one line per problem on stderr.",
    )
    validate.add_argument("--config", required=True, help="recipe YAML file")
    validate.add_argument(
        "overrides",
        nargs="*",
        help="Hydra-style overrides: key=value, +key=value (add), ++key=value (set or add), ~key",
    )
    validate.add_argument(
        "--gpu-memory-gib",
        type=_positive_number,
        default=None,
        help="GPU memory the estimate is compared with, GiB (default: the visible GPU's, else 80)",
    )
    validate.add_argument(
        "--no-estimate",
        action="store_true",
        help="skip the memory estimate (it measures one layer of the model on the CPU the "
        "first time a model is seen)",
    )
    validate.set_defaults(handler=_cmd_validate)
    demo = commands.add_parser(
        "demo",
        help="the embedded default: tiny SFT then GRPO on the arithmetic task",
        description="Run tiny SFT, then GRPO from its checkpoint, on the built-in arithmetic "
        "task on an embedded Ray cluster (one GPU if present, else two CPU workers).",
    )
    demo.add_argument("--output-dir", default="results/demo", help="where runs are written")
    demo.set_defaults(handler=_job(_run_demo))
    telemetry = commands.add_parser(
        "telemetry",
        help="measure a recipe's offloading: memory, time, bytes and bandwidth per step",
        description="Start the recipe's policy workers and train a few steps on random tokens "
        "in the recipe's step shape; print peak GPU memory, step time, bytes offloaded per "
        "module, copy time and achieved GB/s, and pinned host memory per step.",
    )
    telemetry.add_argument("--config", required=True, help="recipe YAML file (any algorithm)")
    telemetry.add_argument("--steps", type=int, default=4, help="training steps (default 4)")
    telemetry.add_argument(
        "--lengths",
        type=_lengths,
        default=None,
        help="comma-separated sequence lengths, cycled over the steps (default: "
        "policy.max_total_sequence_length)",
    )
    telemetry.add_argument(
        "--baseline",
        action="store_true",
        help="run the same steps with offloading off too, and compare",
    )
    telemetry.add_argument("--json", default=None, help="also write the records to this file")
    telemetry.add_argument("overrides", nargs="*", help="Hydra-style overrides")
    telemetry.set_defaults(handler=_job(_run_telemetry))
    plan = commands.add_parser(
        "plan",
        help="pick the activation-memory settings that fit a peak-memory budget fastest",
        description="Compute the recipe's activation ledger on the CPU, profile its policy "
        "with full recompute and without offloading or recompute (which may run out of "
        "memory), predict the peak and time of every offload and recompute setting the rules "
        "allow, measure the most promising ones that fit each budget, and print the fastest "
        "with the override lines to paste. Needs GPU workers. Exit 0 with a plan for every "
        "budget, 1 otherwise. "
        "With --ledger: print what every layer saves for backward and what removes it.",
    )
    plan.add_argument("--config", required=True, help="recipe YAML file")
    plan.add_argument(
        "--budget-gib",
        type=_numbers,
        default=None,
        help="peak GPU memory per worker, GiB; several comma-separated: 20,18",
    )
    plan.add_argument(
        "--budget-fraction",
        type=_numbers,
        default=None,
        help="budgets as fractions of the no-offload peak (measured, or predicted when it does "
        "not fit), e.g. 0.9,0.75,0.6",
    )
    plan.add_argument(
        "--ledger",
        action="store_true",
        help="print the activation ledger instead: every tensor a training step saves, per "
        "layer, with the offload module or recompute option that removes it (runs one layer "
        "of each kind on the CPU here; no GPU, no budget)",
    )
    plan.add_argument("--json", default=None, help="also write the plans (or ledger) to this file")
    plan.add_argument("--steps", type=int, default=3, help="steps per measurement (default 3)")
    plan.add_argument("--max-trials", type=int, default=3, help="candidates to measure (default 3)")
    plan.add_argument("overrides", nargs="*", help="Hydra-style overrides")
    plan.set_defaults(handler=_cmd_plan)
    export_hf = commands.add_parser(
        "export-hf",
        help="write a training checkpoint as a Hugging Face model directory",
        description="Convert a checkpoint written by a training command (a step_N directory, "
        "or a checkpoint_dir: its latest step) to a Hugging Face directory: safetensors "
        "weights, config.json, and the tokenizer files of the model's own directory.",
    )
    export_hf.add_argument("--config", required=True, help="the recipe that trained it")
    export_hf.add_argument("--checkpoint", required=True, help="step directory or checkpoint_dir")
    export_hf.add_argument("--out", required=True, help="a new directory to write")
    export_hf.add_argument(
        "--model-type",
        default=None,
        help="llama, qwen2, qwen3, qwen3_moe or mixtral (default: the source directory's, "
        "else the closest family of the architecture)",
    )
    export_hf.add_argument("overrides", nargs="*", help="Hydra-style overrides of the recipe")
    export_hf.set_defaults(handler=_cmd_export_hf)
    serve = commands.add_parser(
        "serve",
        help="serve a recipe's policy over OpenAI-compatible HTTP endpoints",
        description="Start the recipe's policy workers (weights from --checkpoint, else "
        "policy.init_checkpoint, else the model's own) behind megatron-core's OpenAI-compatible "
        "endpoints (/v1/chat/completions, /v1/completions, /v1/models, /health) and serve until "
        "interrupted. Port: policy.generation.port_range_low/high, else any free one; parsers: "
        "policy.generation.mcore_generation_config.parsers.",
    )
    serve.add_argument("--config", required=True, help="recipe YAML file (any algorithm)")
    serve.add_argument(
        "--checkpoint", default=None, help="a step directory or checkpoint_dir (its latest step)"
    )
    serve.add_argument("overrides", nargs="*", help="Hydra-style overrides")
    serve.set_defaults(handler=_job(_run_serve))
    for name, module, function, what in _TRAINING_COMMANDS:
        command = commands.add_parser(
            name,
            help=f"run {what} from a recipe",
            description=f"Run {what}. The recipe is checked first (as validate does); metrics "
            "go to stdout and <logger.log_dir>/metrics.jsonl, checkpoints to "
            "checkpointing.checkpoint_dir, and an existing checkpoint there is resumed.",
        )
        command.add_argument("--config", required=True, help="recipe YAML file")
        command.add_argument("overrides", nargs="*", help="Hydra-style overrides")
        algorithm = "distillation" if name == "distill" else name
        command.set_defaults(handler=_training_job(module, function, algorithm))
    return parser


def main(
    argv: Sequence[str] | None = None, out: TextIO | None = None, err: TextIO | None = None
) -> int:
    out = out or sys.stdout
    err = err or sys.stderr
    known_warnings.install()  # before anything imports megatron-core
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args, out, err)
    except UserInputError as exc:
        for line in exc.problems:
            print(line, file=err)
        return EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(main())

"""The house plan (docs/architecture.md): data flows one way, config -> offload rules and
models -> the policy's workers -> algorithms -> planning -> CLI. Every import in the package
(module level or inside a function) goes down the layers, never up; no two modules import each
other, even through others; config/ imports neither torch nor Ray."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "nemo_rl_offload"
# Lower layers first; a module may import its own layer or lower ones.
LAYERS = [
    {"errors", "progress", "known_warnings"},
    {"config"},
    {"data", "environments", "offload", "losses"},
    {"distributed", "models", "gpu_monitor", "metrics_logger"},
    {"policy"},
    {"preflight"},
    {"algorithms", "serving", "telemetry", "export_hf"},
    {"planning"},
    {"demo", "cli"},
]
# Known upward imports (none today): (importing file, the layer it reaches up to).
ALLOWED: set[tuple[str, str]] = set()


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "nemo_rl_offload":
            found += [f"nemo_rl_offload.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
    return found


def test_every_import_goes_down_the_layers() -> None:
    level = {unit: index for index, units in enumerate(LAYERS) for unit in units}
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        source = _unit("nemo_rl_offload." + relative.removesuffix(".py").replace("/", "."))
        if source == "__init__":
            continue
        for module in _imports(path):
            if not module.startswith("nemo_rl_offload."):
                continue
            target = _unit(module)
            if level[target] > level[source] and (relative, target) not in ALLOWED:
                upward.append(f"{relative} imports {module}")
    assert upward == []


def test_config_needs_neither_torch_nor_ray() -> None:
    heavy = [
        f"{path.name}: {module}"
        for path in sorted((PACKAGE / "config").glob("*.py"))
        for module in _imports(path)
        if module.split(".")[0] in ("torch", "ray", "megatron")
    ]
    assert heavy == []


def _module_name(path: Path) -> str:
    relative = path.relative_to(PACKAGE.parent).with_suffix("")
    return ".".join(relative.parts).removesuffix(".__init__")


def test_no_module_reaches_itself_through_its_imports() -> None:
    modules = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {
        name: {target for target in _imports(path) if target in modules}
        for name, path in modules.items()
    }
    circles = []
    for start in sorted(graph):
        seen, frontier = set(), list(graph[start])
        while frontier:
            module = frontier.pop()
            if module == start:
                circles.append(start)
                break
            if module not in seen:
                seen.add(module)
                frontier += graph[module]
    assert circles == []

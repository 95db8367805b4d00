#!/usr/bin/env bash
# After ../shared/device/make-wheels.sh: what the GPU machine also needs, within its 64 MiB
# carry (the working tree plus .whl/):
# - Quart, hypercorn and their dependencies (the policy's HTTP server);
# - math-verify, latex2sympy2_extended and antlr4-python3-runtime (env.math's graders; pure
#   Python; the image's sympy serves them);
# - nvidia-modelopt (policy.quant_cfg; pure Python) and pulp (ModelOpt imports it; repacked
#   without its bundled solver binaries, which ModelOpt's quantization never calls);
# - Ray repacked without rllib, serve, tune, data, llm, train and the dashboard's web build (not
#   used here), its binaries stripped of symbols (the tree and .whl/ must stay under 64 MiB).
# The GPU image already has scipy, triton and ninja. Usage: bash scripts/device-wheels-extra.sh
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
wheels="$root/.whl"
[ -d "$wheels" ] || { echo "error: no $wheels; run bash ../shared/device/make-wheels.sh first" >&2; exit 1; }
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_28_x86_64 -d "$tmp" "nvidia-modelopt==0.47.0" "pulp>=3,<4"
cp "$tmp"/nvidia_modelopt-*.whl "$wheels/"
# expose_http_server / serve (megatron-core's endpoints on Quart and hypercorn; pure Python).
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d "$wheels" \
  quart hypercorn flask werkzeug blinker itsdangerous aiofiles h11 h2 hpack hyperframe \
  priority wsproto
# env.math's graders (environments/math_graders.py; pure Python).
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d "$wheels" \
  "math-verify==0.9.0" "latex2sympy2_extended==1.11.0" "antlr4-python3-runtime==4.13.2"
repack() {  # repack WHEEL (a path) without the paths given after it, its binaries stripped
  local wheel="$1"; shift
  local dir="$tmp/x"; rm -rf "$dir"; mkdir "$dir"
  (cd "$dir" && unzip -q "$wheel" && rm -rf "$@" \
     && { find . -type f \( -name '*.so' -o -perm -u+x \) -exec strip --strip-unneeded {} + 2>/dev/null || true; } \
     && rm -f "$wheel.new" && zip -qr -9 "$wheel.new" .)
  mv "$wheel.new" "$wheels/$(basename "$wheel")"
}
repack "$(ls "$tmp"/pulp-*.whl)" pulp/solverdir pulp/tests
ray="$(ls "$wheels"/ray-*.whl)"
cp "$ray" "$tmp/" && repack "$tmp/$(basename "$ray")" ray/rllib ray/serve ray/tune ray/data \
  ray/dashboard/client/build ray/llm ray/train
du -sh "$wheels"

# Sourced by the scripts in benchmarks/ on the GPU machine, from the repository root: installs
# the dependency wheels in .whl/ (for a GPU machine without a package index) into /tmp/site once per machine, puts them
# and the repository on PYTHONPATH, and makes $OUT (each script gives its default first).
# .whl/ is built on the development machine: ../shared/device/make-wheels.sh, then
# scripts/device-wheels-extra.sh.
[ -d /tmp/site/megatron ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
mkdir -p "$OUT"

#!/usr/bin/env bash
# Same-run A/B of the graphed GPU tests (SFT, GRPO, MoE drop-and-pad) between this tree and an
# earlier one, alternating A and B per test so that machine drift hits both alike.
# Run on the GPU machine from the repository root, with the earlier tree extracted (untracked)
# under ab_before/, e.g. `git archive BEFORE_COMMIT | tar -x -C ab_before`:
#     OUT=DIR [TESTS="sft moe grpo"] bash benchmarks/graphs_ab.sh
# (each test takes a few minutes per tree: split TESTS over calls to fit a 10-minute limit).
# Writes DIR/{before,after}/<test results>.json and DIR/graphs_ab.md (benchmarks/graphs_ab.py).
set -u
OUT=${OUT:-/tmp/graphs_ab}
TESTS=${TESTS:-sft moe grpo}
source benchmarks/device_setup.sh
mkdir -p "$OUT/before" "$OUT/after"
run() {  # tree results-dir test-id
    (cd "$1" && NEMO_RL_OFFLOAD_RESULTS="$2" PYTHONPATH=/tmp/site:$PWD timeout 280 \
        python3 -m pytest -m gpu -q -p no:cacheprovider "$3" 2>&1 | tail -1)
}
for name in $TESTS; do
    case $name in
        moe) test="test_graphed_moe_with_drop_and_pad_matches_eager_and_replays" ;;
        *) test="test_graphed_offloading_matches_eager_and_replays[$name]" ;;
    esac
    id="tests/functional/test_cuda_graphs_gpu.py::$test"
    echo "after  $test: $(run "$PWD" "$OUT/after" "$id")"
    echo "before $test: $(run "$PWD/ab_before" "$OUT/before" "$id")"
done
python3 benchmarks/graphs_ab.py "$OUT" > "$OUT/graphs_ab.md"; cat "$OUT/graphs_ab.md"

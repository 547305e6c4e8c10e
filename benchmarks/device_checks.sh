#!/usr/bin/env bash
# One lease of a GPU machine, in one call: what the machine is, every family's forward, operators
# and kernels against XLA (benchmarks.accelerator_probe), the kernel tests with the compiled
# kernels, then, alone on the GPU, Pallas against XLA for each core type (benchmarks.gpu).
#
#   bash benchmarks/device_checks.sh OUTDIR [FAMILIES]   # FAMILIES: comma-separated, for the timings
#
# Each step has a time limit (PROBE_S, TESTS_S, BENCH_S seconds) and writes to OUTDIR as it goes,
# so a step cut short leaves what it did. STEPS picks steps ("probe tests bench"), PROBE_ONLY the
# probe's families, WORKERS the test processes. On an H200 (2026-12-04) the probe took 4-28 s a
# family, the tests (6 workers, beside the probe) over 240 s, the timings 80 s a family. Runs from
# the repository root with the machine's python3 (its own jax, flax, torch); nothing is installed.
set -u
out=${1:?usage: device_checks.sh OUTDIR [FAMILIES]}
families=${2:-qwen3_next,rwkv7,xlstm,lfm2,kimi_linear,falcon_h1,recurrent_gemma,mamba2,mamba,rwkv}
steps=${STEPS:-probe tests bench}  # any of: probe tests bench
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
start=$(date +%s)
stamp() { echo "[$(( $(date +%s) - start ))s] $*"; }

{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,temperature.gpu --format=csv
  $py -c "import sys, jax, flax; print(sys.version.split()[0], 'jax', jax.__version__, 'flax', flax.__version__,
    [d.device_kind for d in jax.devices()])"
} > "$out/env.txt" 2>&1
cat "$out/env.txt"

# correctness: the probe and the tests side by side (compiling is most of their time). SIGINT at
# the limit: pytest then still prints the failures it has seen.
stamp "probe and tests"
case " $steps " in *" probe "*)
  timeout "${PROBE_S:-240}" $py -m benchmarks.accelerator_probe ${PROBE_ONLY:+--only $PROBE_ONLY} \
    --out "$out/probe.json" > /dev/null 2> "$out/probe.log" & ;; esac
case " $steps " in *" tests "*)
  timeout -s INT "${TESTS_S:-240}" $py -m pytest -p no:cacheprovider -v --tb=short -n "${WORKERS:-8}" \
    -m "deep or not deep" -o addopts="" --dist load -rfEs tests/test_kernels.py tests/test_dispatch.py \
    tests/test_nan.py::test_pallas_kernels_keep_nan_causal \
    tests/test_nan.py::test_pallas_kernels_keep_exact_zeros_above_the_diagonal_after_an_overflow \
    tests/test_las.py::test_kernel_matches_float64_and_xla tests/test_las.py::test_pallas_reduce_against_float64 \
    tests/test_las.py::test_pallas_kernel_skips_exactly_the_column_tiles_no_row_sees > "$out/pytest.log" 2>&1 & ;;
esac
wait
stamp "probe and tests done"

# speed: alone on the GPU
case " $steps " in *" bench "*)
  stamp "benchmark"
  timeout "${BENCH_S:-270}" $py -m benchmarks.gpu --parts operators --only "$families" > "$out/bench.log" 2>&1
  echo "benchmark rc=$?" ;;
esac
for f in benchmarks/results/gpu_operators.json benchmarks/results/gpu_operators.md; do
  [ "$f" -nt "$out/env.txt" ] && cp "$f" "$out/"  # only a table this run wrote
done
stamp "done"

echo "== probe: failed or off"; grep -h '"FAIL\|"OFF' "$out/probe.json" | head -40; tail -3 "$out/probe.log"
echo "== tests"; grep -E "^(FAILED|ERROR)|passed|failed" "$out/pytest.log" | tail -30
echo "== benchmark"; cat "$out/gpu_operators.md" 2>/dev/null || tail -20 "$out/bench.log"

#!/usr/bin/env bash
# The one script to run on a GPU machine (H100/H200): GPU tests, then the benchmark sweep.
#
#   benchmarks/run_gpu.sh [--tests gpu|all|none] [--budget SECONDS] [--compile-budget SECONDS]
#                         [--] [extra `python -m fusedops bench` flags...]
#
#   --tests gpu     (default) python -m pytest -m gpu -q tests
#   --tests all     the whole suite on the GPU machine (-n 8), Triton compiled, not interpreted
#   --tests none    skip the tests
#   --budget S      wall-clock budget of the whole script (default 480 s); the sweep starts no new
#                   point once it is spent and still writes everything it measured
#   --compile-budget S   seconds of torch.compile after which that provider is skipped
#                   (default 200 s; the compile baseline is the slow part of the sweep)
#
# Writes into $OUT (default out/gpu): <gpu>-<date>.json/.csv/.txt, PNGs (one per op for up to
# four ops, else one per family: see --plot-by) and pytest.log; prints a short table last.
# Committed results go to benchmarks/results/<gpu>/ (see its README).
# Liger-Kernel, QuACK: if .whl/ holds wheels (the machine needs no network), they are installed
# to /tmp/site (without their dependencies).
set -uo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)

TESTS=gpu
BUDGET=480
COMPILE_BUDGET=200
BENCH_ARGS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --tests) TESTS="$2"; shift 2 ;;
        --tests=*) TESTS="${1#*=}"; shift ;;
        --budget) BUDGET="$2"; shift 2 ;;
        --budget=*) BUDGET="${1#*=}"; shift ;;
        --compile-budget) COMPILE_BUDGET="$2"; shift 2 ;;
        --compile-budget=*) COMPILE_BUDGET="${1#*=}"; shift ;;
        --) shift; BENCH_ARGS+=("$@"); break ;;
        *) BENCH_ARGS+=("$1"); shift ;;
    esac
done
case "$TESTS" in gpu|all|none) ;; *) echo "--tests must be gpu, all or none" >&2; exit 2 ;; esac

OUT="${OUT:-out/gpu}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
# Compiled Triton kernels, not the interpreter (tests/conftest.py defaults it to 1 when unset).
export TRITON_INTERPRET=0

if compgen -G ".whl/*.whl" >/dev/null; then
    if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl; then
        export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
    else
        echo "run_gpu.sh: installing .whl/*.whl failed; going on without them" >&2
    fi
fi

"$PY" - <<'EOF'
import torch
try:
    import triton
    tv = triton.__version__
except Exception as exc:
    tv = f"missing ({exc})"
try:
    from liger_kernel.ops.softmax import LigerSoftmaxFunction  # noqa: F401
    from importlib.metadata import version
    lv = version("liger-kernel")
except Exception as exc:
    lv = f"not importable ({type(exc).__name__})"
try:
    import importlib
    importlib.import_module("quack.softmax")
    from importlib.metadata import version
    qv = version("quack-kernels")
except Exception as exc:
    qv = f"not importable ({type(exc).__name__})"
name = torch.cuda.get_device_name() if torch.cuda.is_available() else "NO CUDA DEVICE"
print(f"run_gpu.sh: {name}; torch {torch.__version__}; triton {tv}; liger-kernel {lv}; "
      f"quack-kernels {qv}")
EOF

TEST_RC=0
if [ "$TESTS" != none ]; then
    if [ "$TESTS" = gpu ]; then
        TEST_CMD=("$PY" -m pytest -m gpu -q -p no:cacheprovider tests)
    else
        TEST_CMD=("$PY" -m pytest -x -q -n 8 -p no:cacheprovider tests)
    fi
    echo "run_gpu.sh: ${TEST_CMD[*]} (log: $OUT/pytest.log)"
    "${TEST_CMD[@]}" >"$OUT/pytest.log" 2>&1
    TEST_RC=$?
    # The failures' short summary and the final count line.
    grep -E "^(FAILED|ERROR)|[0-9]+ (passed|failed|error)|no tests ran" "$OUT/pytest.log" \
        | tail -n 15
    echo "run_gpu.sh: tests exit code $TEST_RC ($(( $(date +%s) - T0 )) s so far)"
fi

LEFT=$(( BUDGET - ($(date +%s) - T0) - 25 ))  # 25 s for the last point's tail and the plots
if [ "$LEFT" -lt 30 ]; then LEFT=30; fi
echo "run_gpu.sh: sweep with a ${LEFT} s budget (compile budget ${COMPILE_BUDGET} s)"
"$PY" -m fusedops bench --device cuda --out "$OUT" --time-budget "$LEFT" \
    --compile-budget "$COMPILE_BUDGET" --table short "${BENCH_ARGS[@]}"
BENCH_RC=$?
echo "run_gpu.sh: done in $(( $(date +%s) - T0 )) s; tests rc $TEST_RC, bench rc $BENCH_RC;" \
     "files in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
if [ "$TEST_RC" -ne 0 ]; then exit "$TEST_RC"; fi
exit "$BENCH_RC"

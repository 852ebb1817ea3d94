#!/usr/bin/env bash
# The prepared GPU check, one command of about 7.5 minutes on an H100 or H200 (its parts' limits:
# tests 240 s, benchmarks 70 + 60 + 30 + 50 s), so that the machine's start and a second call fit
# in a 15-minute lease:
#   1. the CUDA tests: the Triton kernels (bfloat16 too), every path on the device, the
#      adversarial suite on the device (SHARPATTN_TEST_DEVICE=cuda), on parallel workers (their
#      time is Triton's compiler: one worker reached 77 of about 730 tests in 210 s on an H200),
#      each test's name and result written as it ends, so a run cut short still names its failures;
#   2. benchmarks/gpu.py in bfloat16 and float32, in separate runs by family (a slow or stuck
#      cell ends its own run only), each cell named before it runs; and the anchors (other
#      projects' kernels of the same maps: AdaSplash, stick-breaking) where their wheels are in
#      benchmarks/wheels.
# Results go to $OUT (default benchmarks/results); the tests' log to $OUT/gpu_tests.log.
# Run from the repository root: bash benchmarks/gpu_check.sh
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
PY=${PYTHON:-python}
# the anchors' packages (benchmarks/gpu.py ANCHORS), from wheels carried to the machine
ANCHORS=/tmp/sharpattn-anchors
if ls benchmarks/wheels/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-deps --no-index --target "$ANCHORS" benchmarks/wheels/*.whl \
    || echo "anchor wheels: not installed"
fi
export PYTHONPATH="$PWD/src:$PWD/benchmarks:$ANCHORS${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
start=$(date +%s)
elapsed() { echo "$(( $(date +%s) - start )) s"; }

if $PY -c "import pytest, hypothesis" 2>/dev/null; then
  workers=()
  $PY -c "import xdist" 2>/dev/null && workers=(-n "${GPU_TEST_WORKERS:-12}")
  per_test=()  # a test stuck in a kernel: its worker's stack is dumped and the rest go on
  $PY -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout 120)
  timeout 240 env SHARPATTN_TEST_DEVICE=cuda $PY -m pytest -v -rfE -p no:cacheprovider \
    -W ignore::pytest.PytestWarning "${workers[@]}" "${per_test[@]}" \
    tests/paths/test_triton.py tests/paths/test_triton_stick.py tests/paths/test_devices.py \
    tests/contract/test_adversarial.py >"$OUT/gpu_tests.log" 2>&1
  code=$?
  grep -E "(FAILED|ERROR|Timeout)" "$OUT/gpu_tests.log" | sed 's/^\[gw[0-9]*\] *\[ *[0-9]*%\] *//' \
    | sort -u | head -40
  echo "tests: $(grep -c ' PASSED' "$OUT/gpu_tests.log") passed," \
    "$(grep -c ' FAILED' "$OUT/gpu_tests.log") failed, exit $code after $(elapsed)"
  tail -3 "$OUT/gpu_tests.log"
else
  echo "tests skipped: pytest and hypothesis are not installed here"
fi

SOFTMAX="softmax,ssmax,sink,adaptive"
ELEMENTWISE="sigmoid,relu,power,signed,softpick,stick_breaking,anchor:stickbreaking"
SPARSE="sparsemax,entmax15,entmax@alpha=1.3,asentmax,topk,hardmax,anchor:adasplash"
bench() {  # bench SECONDS NAME ARGS...: one gpu.py run, killed after SECONDS
  local limit=$1 name=$2
  shift 2
  timeout "$limit" $PY benchmarks/gpu.py --out "$OUT/$name.json" "$@"
  echo "$name: exit $? at $(elapsed)"
}
# 16 heads: at 4 (the float32 tables' shape) a bfloat16 call up to 4k is mostly launch overhead
bench 70 gpu_bf16 --dtype bfloat16 --heads 16 --sizes 1024,4096,16384,65536 \
  --methods "$SOFTMAX,$ELEMENTWISE" --deadline 55
bench 60 gpu_bf16_sparse --dtype bfloat16 --heads 16 --sizes 1024,4096,16384 \
  --methods "$SPARSE" --deadline 45
bench 30 gpu_bf16_tiles --dtype bfloat16 --sizes 4096 --modes fwdbwd \
  --methods "sigmoid:tiles,softpick:tiles,adaptive:tiles,sparsemax:tiles,stick_breaking:tiles" \
  --deadline 20
bench 50 gpu --dtype float32 --sizes 1024,4096,16384 \
  --methods "$SOFTMAX,$ELEMENTWISE,$SPARSE" --deadline 40
echo "gpu_check: $(elapsed)"

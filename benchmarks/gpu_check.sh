#!/usr/bin/env bash
# The prepared GPU check, one command of at most 8 minutes on an H100 or H200:
#   1. the CUDA tests: the Triton kernels (bfloat16 too), every path on the device, the
#      adversarial suite on the device (SHARPATTN_TEST_DEVICE=cuda);
#   2. benchmarks/gpu.py in bfloat16 (n = 1k to 64k) and float32 (1k to 16k) for the methods
#      with CUDA kernels (every method but the plug-ins') and some of their rows without them
#      (":tiles"), each with a deadline; and the anchors (other projects' kernels of the same
#      maps: AdaSplash, stick-breaking) where their wheels are in benchmarks/wheels.
# Results go to $OUT (default benchmarks/results); the tests' log to $OUT/gpu_tests.log.
# Run from the repository root: bash benchmarks/gpu_check.sh
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
start=$(date +%s)
# the anchors' packages (benchmarks/gpu.py ANCHORS), from wheels carried to the machine
if ls benchmarks/wheels/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-deps --no-index benchmarks/wheels/*.whl || echo "anchor wheels: not installed"
fi

if $PY -c "import pytest, hypothesis" 2>/dev/null; then
  timeout 210 env SHARPATTN_TEST_DEVICE=cuda $PY -m pytest -q -p no:cacheprovider \
    tests/paths/test_triton.py tests/paths/test_triton_stick.py tests/paths/test_devices.py \
    tests/contract/test_adversarial.py \
    2>&1 | tee "$OUT/gpu_tests.log" | tail -25
  echo "tests: exit ${PIPESTATUS[0]} after $(( $(date +%s) - start )) s"
else
  echo "tests skipped: pytest and hypothesis are not installed here"
fi

FAST="softmax,ssmax,sink,adaptive,sigmoid,relu,power,signed,softpick"
FAST="$FAST,sparsemax,entmax15,entmax@alpha=1.3,asentmax,topk,hardmax,stick_breaking"
FAST="$FAST,anchor:adasplash,anchor:stickbreaking"
$PY benchmarks/gpu.py --dtype bfloat16 --sizes 1024,4096,16384,65536 --methods "$FAST" \
  --deadline 150 --out "$OUT/gpu_bf16.json" | tail -30
$PY benchmarks/gpu.py --dtype bfloat16 --sizes 4096,16384 --modes fwdbwd \
  --methods "sigmoid:tiles,softpick:tiles,sink:tiles,adaptive:tiles,sparsemax:tiles,topk:tiles,stick_breaking:tiles" \
  --deadline 40 --out "$OUT/gpu_bf16_tiles.json" | tail -14
$PY benchmarks/gpu.py --dtype float32 --sizes 1024,4096,16384 --methods "$FAST" \
  --deadline 60 --out "$OUT/gpu.json" | tail -26
echo "gpu_check: $(( $(date +%s) - start )) s"

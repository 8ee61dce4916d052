#!/usr/bin/env bash
# The one call a lent GPU session makes (15 minutes of device time in all, the machine's start
# included): what the open issues still need measured, in order of what they need most, each
# part under its own time limit so a slow one cannot eat the others'.
#
#   run (device tool): bash bench/gpu_session.sh .whl        carry: [".whl"], timeout_s 600
#   smoke (CPU):       bash bench/gpu_session.sh --smoke     the same steps' code paths
#
# .whl (ignored by git): wheels for the GPU machine's Python (diffusers, ftfy, wcwidth, torchao;
# `pip download --no-deps --python-version 3.12 --only-binary :all: -d .whl ...`). Everything
# lands in $OUT (the device tool returns it), one log per part:
#   1. quantize fp8 on the GPU (issue 39; never run there before 2026-11-28): torchao's FP8
#      layers against fp8-sim on one linear and a whole forward, eager and compiled, and a
#      Runner request (tests/models/test_quantize_fp8.py, its cuda cases); sharded weights on
#      CUDA (issue 42; the side-stream gathers never ran before): two ranks on the one GPU,
#      fp8-sim and fp8, bit for bit against unsharded (tests/models/test_shard_cuda.py); the
#      GPU's peak while FP8 weights are quantized at load (test_quantize_fp8); full-precision
#      steps under fp8 bit for bit (tests/models/test_full_precision_steps.py, its cuda case);
#   2. every family at real widths on one GPU (issue 40 item 2; issue 42's one-rank peak
#      memory against the planner): bench/bench_familysteps.py -> $OUT/familysteps.json;
#   3. quantizing FP8 weights at load, on the GPU one linear at a time against the host
#      (issue 42): bench/bench_quantize_load.py -> $OUT/quantize-load.json;
#   4. sparse attention's CUDA kernel (issue 55; compiled FlexAttention, never run on a GPU) at
#      75% and 90% sparsity against cuDNN dense at Wan 14B's 69 x 768 x 1280:
#      bench/bench_sparse_gpu.py -> $OUT/sparse-gpu.json; and the CUDA cases of
#      tests/parallel/test_sparse_attention.py.
set -o pipefail
SMOKE=""
if [ "${1:-}" = "--smoke" ]; then SMOKE="--smoke"; shift; fi
WHEELS=${1:-}
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -n "$WHEELS" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/raydit-site "$WHEELS"/*.whl \
    || { echo "gpu_session: could not install the wheels of $WHEELS" >&2; exit 3; }
  export PYTHONPATH=/tmp/raydit-site:$PWD
else
  export PYTHONPATH=$PWD
fi
PY=${PYTHON:-python3}
{ nvidia-smi -L 2>/dev/null || echo "no nvidia-smi"; "$PY" -c "import torch; print('torch', torch.__version__)"; } \
  | tee "$OUT/device.txt"

echo "== 1. quantize fp8 and sharded weights on the GPU (tests/models/test_quantize_fp8.py, test_shard_cuda.py)"
K=$([ -n "$SMOKE" ] && echo cpu || echo cuda)
timeout 240 "$PY" -m pytest -q -p no:cacheprovider -rs tests/models/test_quantize_fp8.py tests/models/test_shard_cuda.py \
  tests/models/test_full_precision_steps.py \
  -k "$K" 2>&1 | grep -v "kept in float32\|Casting directly" | tail -40 | tee "$OUT/gpu-tests.txt"

echo "== 2. every family at real widths (bench/bench_familysteps.py)"
timeout 290 "$PY" bench/bench_familysteps.py $SMOKE --budget-s 230 --out "$OUT" 2>&1 \
  | grep -v "kept in float32\|Casting directly" | tee "$OUT/familysteps-log.txt"

echo "== 3. quantizing FP8 weights at load (bench/bench_quantize_load.py)"
timeout 50 "$PY" bench/bench_quantize_load.py $SMOKE --modes fp8 --repeat 1 --out "$OUT" 2>&1 \
  | grep -v "kept in float32\|Casting directly" | tee "$OUT/quantize-load-log.txt"
echo "== 4. sparse attention on CUDA (bench/bench_sparse_gpu.py, tests/parallel/test_sparse_attention.py)"
timeout 200 "$PY" bench/bench_sparse_gpu.py $SMOKE --out "$OUT/sparse-gpu.json" 2>&1 | tail -20 | tee "$OUT/sparse-gpu-log.txt"
timeout 100 "$PY" -m pytest -q -p no:cacheprovider -rs tests/parallel/test_sparse_attention.py -k "$K" 2>&1 \
  | tail -20 | tee "$OUT/sparse-gpu-tests.txt"
echo "gpu_session: done; files in $OUT"

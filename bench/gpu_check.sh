#!/usr/bin/env bash
# On a CUDA machine: the Triton kernels' tests compiled for the GPU, then bench/gpu_check.py (correctness against
# transformers and the torch attention; the Llama-3.1-8B-shaped speed, kernel, host-time and serving figures).
# Logs go to ${OUT:-gpu_check_out}/. Not part of CI. Worst case (every timeout hit) 7 minutes.
#   bash bench/gpu_check.sh [gpu_check.py options, e.g. --skip llama8b]
set -u
out=${OUT:-gpu_check_out}
mkdir -p "$out"
py=${PYTHON:-python3}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
$py -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
echo "== Triton kernels (compiled, KVBENCH_TEST_GPU=1)"
KVBENCH_TEST_GPU=1 timeout 60 $py -m pytest -q -p no:cacheprovider tests/runtime/test_triton_attention.py \
    tests/runtime/test_triton_decode.py 2>&1 | tee "$out/pytest_triton.log" | tail -25
timeout 30 $py -m pytest -q -p no:cacheprovider tests/quant/test_codecs.py tests/runtime/test_quantized_cache.py \
    -k triton 2>&1 | tee "$out/pytest_triton_dequant.log" | tail -8
echo "== bench/gpu_check.py (the SmolLM2-shaped speed/serving sections are skipped: the 8B section supersedes them)"
PYTHONUNBUFFERED=1 timeout 330 $py bench/gpu_check.py --json "$out/gpu_check.json" --skip speed,serving \
    --llama8b-serving-budget-s 100 "$@" 2>&1 | tee "$out/gpu_check.log"

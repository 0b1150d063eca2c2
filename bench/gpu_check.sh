#!/usr/bin/env bash
# On a CUDA machine: the Triton kernels' tests compiled for the GPU, then bench/gpu_check.py (correctness against
# transformers and the torch attention, speed, serving). Logs go to ${OUT:-gpu_check_out}/. Not part of CI.
#   bash bench/gpu_check.sh [--quick]
set -u
out=${OUT:-gpu_check_out}
mkdir -p "$out"
py=${PYTHON:-python3}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
$py -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
echo "== Triton kernels (compiled, KVBENCH_TEST_GPU=1)"
KVBENCH_TEST_GPU=1 timeout 120 $py -m pytest -q -p no:cacheprovider tests/test_triton_attention.py \
    2>&1 | tee "$out/pytest_triton_attention.log" | tail -25
timeout 50 $py -m pytest -q -p no:cacheprovider tests/test_quant_codecs.py tests/test_quantized_cache.py -k triton \
    2>&1 | tee "$out/pytest_triton_dequant.log" | tail -8
echo "== bench/gpu_check.py"
PYTHONUNBUFFERED=1 timeout 330 $py bench/gpu_check.py --json "$out/gpu_check.json" "$@" 2>&1 | tee "$out/gpu_check.log"
echo "== bench/bench_triton_attention.py --quick"
PYTHONUNBUFFERED=1 timeout 50 $py bench/bench_triton_attention.py --quick 2>&1 | tee "$out/bench_triton_attention.log"

"""The CPU backend: C kernels (csrc/, compiled on first use) behind `backend.CpuBackend`, the projections' weight
layouts (`linear`), weights kept in a GGUF's quantized blocks (`quant_linear`, csrc/quant_matmul.c), the fused decode
step (`fused_decode`) and the OpenMP thread policy (`threads`).

No torch import at package level: kvbench/__init__.py imports `threads` before torch is loaded."""

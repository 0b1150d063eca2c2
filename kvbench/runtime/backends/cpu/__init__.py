"""The CPU backend: C kernels (csrc/, compiled on first use) behind `backend.CpuBackend`, the projections' weight
layouts (`linear`), the fused decode step (`fused_decode`) and the OpenMP thread policy (`threads`).

No torch import at package level: kvbench/__init__.py imports `threads` before torch is loaded."""

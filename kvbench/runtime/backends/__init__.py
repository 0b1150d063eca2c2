"""Attention backends: the kernels under the runtime core, behind one small interface (`base.AttentionBackend`).

    torch/   the reference: paged attention in plain torch (every feature: per-key attention mass, keys rotated at
             read time, any device and dtype)
    cpu/     C kernels loaded with ctypes (csrc/): decode and chunked-prefill attention, attention over a codec
             cache's packed blocks, whole fused decode layers, the GEMV of the projections, and the OpenMP thread
             policy
    triton/  the Triton paged attention for CUDA and the Triton dequantizer of packed blocks

`selection.select_backend` picks one per engine (runtime.attention_backend = auto | torch | cpu | triton). The model
calls the chosen backend's `fused_decode`, and the cache calls its `attend` (full-precision blocks) or
`attend_packed` (a codec's packed blocks: a backend reads them only for a codec that lists its kernel in
`codec.kernels`). The triton package's modules are imported only when chosen (`triton.load`): they import triton,
an optional dependency, and their @triton.jit kernels read TRITON_INTERPRET when they are defined.

Nothing here imports torch at package level: kvbench/__init__.py imports cpu/threads.py before torch is loaded.
"""

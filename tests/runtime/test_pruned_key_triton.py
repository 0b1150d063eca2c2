"""The Triton backend over a PrunedKeyKVCache (ThinK's layout, which no Triton kernel reads in place): the cache hands
it the layer dequantized, and decode and prefill attention equal the Triton kernels' over a full-precision cache with
the same channels zeroed, and the torch reference's (CPU: the Triton interpreter, fp32; run this file alone, as the
other Triton files: TRITON_INTERPRET must be set before the kernels' modules are imported)."""

import os

ON_GPU = os.environ.get("KVBENCH_TEST_GPU") == "1"
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"  # before importing any module that defines a @triton.jit kernel

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from kvbench.runtime.backends.torch.backend import TORCH  # noqa: E402
from kvbench.runtime.backends.triton import attention as ta  # noqa: E402
from kvbench.runtime.backends.triton.backend import TritonBackend  # noqa: E402
from tests.runtime.test_pruned_key_cache import H, L, _append, _channels, _pair  # noqa: E402

if not ON_GPU and not ta._interpreting():  # pragma: no cover
    pytest.skip("the Triton kernels were imported before TRITON_INTERPRET=1 was set; run this file alone",
                allow_module_level=True)
if ON_GPU and not torch.cuda.is_available():  # pragma: no cover
    pytest.skip("KVBENCH_TEST_GPU=1 needs a CUDA GPU", allow_module_level=True)


@pytest.mark.parametrize("Q", [1, 5])
def test_triton_attends_over_the_pruned_layout(Q):
    g = torch.Generator().manual_seed(1)
    plain, pruned = _pair()
    caches = (plain, pruned)
    slots = [c.add_sequence() for c in caches]
    _append(caches, slots, 23, 0, g)
    for layer in range(L):
        ch = _channels(g)
        for c, s in zip(caches, slots):
            c.prune_key_channels(layer, s, ch)
    k, v = torch.randn(L, H, Q, 8, generator=g), torch.randn(L, H, Q, 8, generator=g)
    q = torch.randn(1, 2 * H, Q, 8, generator=g)
    plans = []
    for c, s in zip(caches, slots):
        plan = c.prepare_append([s], torch.arange(23, 23 + Q)[None])
        for layer in range(L):
            c.write(layer, plan, k[layer][None], v[layer][None])
        plans.append(plan)
    causal = Q > 1
    for layer in range(L):
        outs = [c.attend(layer, q, p, 8 ** -0.5, backend=b, causal=causal)[0]
                for c, p in zip(caches, plans) for b in (TritonBackend(), TORCH)]
        for o in outs[1:]:
            torch.testing.assert_close(o, outs[0], atol=1e-5, rtol=1e-5)

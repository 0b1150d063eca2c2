"""Page retrieval (kvbench.runtime.cache.page_retrieval) over the split-KV Triton decode kernel: given the compacted
tables select_pages returns, the kernel equals attention over those blocks gathered by torch, and reads nothing else
(every block that was not selected is poisoned with NaN). Under the Triton interpreter (fp32 / fp16; compiled on a
GPU with KVBENCH_TEST_GPU=1)."""

from tests.runtime.test_triton_attention import DEVICE, ON_GPU, TOL  # noqa: I001  (sets TRITON_INTERPRET first)

import pytest  # noqa: E402
import torch  # noqa: E402

from kvbench.runtime.backends.triton import decode as td  # noqa: E402
from kvbench.runtime.backends.triton.attention import _interpreting  # noqa: E402
from kvbench.runtime.cache.block_summaries import BlockSummaries  # noqa: E402
from kvbench.runtime.cache.page_retrieval import select_pages, select_pages_per_head  # noqa: E402

if not ON_GPU and not _interpreting():  # pragma: no cover
    pytest.skip("the Triton modules were imported before TRITON_INTERPRET=1 was set", allow_module_level=True)


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("pages", [3, 5])
def test_triton_decode_reads_only_the_selected_blocks(dtype, pages, per_head):
    """per_head (quest.gqa=per_head): one table per query head, read by the same kernel as H * G kv-heads of one
    query head each."""
    g = torch.Generator().manual_seed(pages)
    B, H, G, D, bs = 2, 2, 2, 32, 16
    lengths = torch.tensor([[150, 131], [97, 160]])
    MB = 10
    N = 1 + B * H * MB
    ids = (torch.randperm(N - 1, generator=g) + 1).view(B, H, MB).to(torch.int32)
    k_pool = torch.randn(N, bs, D, generator=g).to(dtype)
    v_pool = torch.randn(N, bs, D, generator=g).to(dtype)
    k_pool[0], v_pool[0] = 0, 0  # the scratch block
    summ = BlockSummaries(N, bs, D, torch.device("cpu"))
    for b in range(B):
        for h in range(H):
            t = torch.arange(int(lengths[b, h]))
            rows = ids[b, h, t // bs].to(torch.int64) * bs + t % bs
            summ.update(rows, k_pool.view(-1, D)[rows])
    q = torch.randn(B, H * G, 1, D, generator=g).to(dtype)
    select = select_pages_per_head if per_head else select_pages
    sel_t, sel_l = select(q[:, :, 0], summ.summary, ids, lengths, bs, pages)  # [B, H or H * G, U]
    group = 1 if per_head else G  # query heads per table
    assert bool((sel_l < lengths.repeat_interleave(G // group, dim=1)).all())
    read = torch.zeros(N, dtype=torch.bool)  # the blocks the selection names
    read[0] = True  # the scratch block (zeros): padding columns name it
    for b in range(B):
        for h in range(sel_t.shape[1]):
            read[sel_t[b, h, : -(-int(sel_l[b, h]) // bs)].long()] = True
    ref = torch.zeros(B, H * G, 1, D, dtype=torch.float64)
    for b in range(B):  # gathered by torch, before the poison
        for h in range(sel_t.shape[1]):
            n = int(sel_l[b, h])
            blocks = sel_t[b, h, : -(-n // bs)].long()
            k = k_pool[blocks].reshape(-1, D)[:n].double()
            v = v_pool[blocks].reshape(-1, D)[:n].double()
            for j in range(group):
                w = torch.softmax(k @ q[b, h * group + j, 0].double() * D ** -0.5, 0)
                ref[b, h * group + j, 0] = w @ v
    k_pool[~read] = float("nan")  # a block not selected must not be read
    v_pool[~read] = float("nan")
    out, _ = td.paged_decode_triton(q.to(DEVICE), k_pool.to(DEVICE), v_pool.to(DEVICE), sel_t.to(DEVICE),
                                    sel_l.to(torch.int32).to(DEVICE), D ** -0.5)
    assert bool(torch.isfinite(out).all()), "read a block that was not selected"
    torch.testing.assert_close(out.double().cpu(), ref, **TOL[dtype])

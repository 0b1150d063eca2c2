"""The C kernels of the CPU decode path equal their torch references (attention on real paged caches)."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

from kvbench.runtime.backends.cpu import kernels as cpu_kernels
from kvbench.runtime.backends.torch.attention import paged_attention_torch
from kvbench.runtime.cache.kv_cache import PagedKVCache
from tests.tiny_models import tiny_model

# a machine with a C compiler must build the kernels: a build error fails here instead of skipping
pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler")


@pytest.fixture(autouse=True, scope="module")
def _kernels_loaded():
    """The ctypes wrappers that call the library directly (rms_norm, rotary_, gemv) need it loaded: whichever test
    a worker runs first."""
    cpu_kernels.load_kernel()


def test_kernels_build():
    assert cpu_kernels.load_kernel() is not None, cpu_kernels.kernel_error()


def filled_cache(lengths, *, L=2, H=2, D=32, bs=8, seed=0):
    """A cache with one sequence per entry of `lengths`, written chunk by chunk so blocks interleave."""
    torch.manual_seed(seed)
    cache = PagedKVCache(num_layers=L, num_kv_heads=H, head_dim=D, block_size=bs, num_blocks=4000, max_seqs=8)
    slots = [cache.add_sequence() for _ in lengths]
    done = [0] * len(lengths)
    while any(d < n for d, n in zip(done, lengths)):
        for i, (s, n) in enumerate(zip(slots, lengths)):
            q = min(37, n - done[i])
            if q <= 0:
                continue
            plan = cache.prepare_append([s], torch.arange(done[i], done[i] + q).unsqueeze(0))
            for layer in range(L):
                cache.write(layer, plan, torch.randn(1, H, q, D), torch.randn(1, H, q, D))
            done[i] += q
    return cache, slots


def both(cache, slots, layer, q, key_scores=True):
    idx = torch.tensor(slots)
    tables, lengths, positions = cache.layer_tables(layer, idx)
    qpos = lengths.max(dim=1).values.unsqueeze(1)
    args = (q, cache.k_pool, cache.v_pool, tables, lengths, positions, qpos, 0.17)
    ref = paged_attention_torch(*args, causal=False, return_key_scores=key_scores)
    fast = cpu_kernels.paged_attention_cpu(*args, causal=False, return_key_scores=key_scores)
    if key_scores:  # the torch reference's decode key scores cover the tables' width, zero past the longest length
        (ref_out, ref_ks), width = ref, fast[1].shape[-1]
        assert ref_ks.shape[-1] >= width and not ref_ks[..., width:].any()
        ref = (ref_out, ref_ks[..., :width])
    return ref, fast


@pytest.mark.parametrize("items_per_thread", [1, 16])  # one chunk of keys per table, or several merged
@pytest.mark.parametrize("lengths,group", [([1], 1), ([300], 3), ([1000], 4), ([5, 513, 256, 1024], 2)])
def test_kernel_matches_reference_on_ragged_batches(lengths, group, items_per_thread, monkeypatch):
    monkeypatch.setattr(cpu_kernels, "ITEMS_PER_THREAD", items_per_thread)
    cache, slots = filled_cache(lengths)
    H, D = cache.num_kv_heads, cache.head_dim
    q = torch.randn(len(lengths), H * group, 1, D)
    for layer in range(cache.num_layers):
        (ref, ref_ks), (out, ks) = both(cache, slots, layer, q)
        assert out.shape == ref.shape and ks.shape == ref_ks.shape
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ks, ref_ks, atol=1e-6, rtol=1e-5)


def test_kernel_after_eviction_heads_of_different_lengths():
    """Token- and block-level eviction leave heads and layers with different lengths and tables."""
    cache, (s,) = filled_cache([700])
    keep = torch.stack([torch.arange(0, 700, 3)[:200], torch.arange(100, 700, 2)[:200]])
    keep[1, 150:] = -1  # head 1 keeps fewer tokens
    cache.keep_tokens(0, s, keep)
    cache.evict_blocks(1, s, 0, [0, 5, 7])
    q = torch.randn(1, 2 * cache.num_kv_heads, 1, cache.head_dim)
    for layer in range(cache.num_layers):
        (ref, ref_ks), (out, ks) = both(cache, [s], layer, q)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ks, ref_ks, atol=1e-6, rtol=1e-5)
    (ref, _), (out, none) = both(cache, [s], 0, q, key_scores=False)
    assert none is None
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_other_calls_fall_back_to_the_reference():
    """Prefill chunks, pre-RoPE keys and non-fp32 pools are not the kernel's: the reference answers."""
    cache, (s,) = filled_cache([40])
    tables, lengths, positions = cache.layer_tables(0, torch.tensor([s]))
    q = torch.randn(1, 4, 3, cache.head_dim)
    qpos = torch.tensor([[37, 38, 39]])
    args = (q, cache.k_pool, cache.v_pool, tables, lengths, positions, qpos, 0.2)
    ref, _ = paged_attention_torch(*args, causal=True)
    out, _ = cpu_kernels.paged_attention_cpu(*args, causal=True)
    assert torch.equal(out, ref)


def test_engine_uses_the_kernel_on_cpu_and_generates_like_the_reference():
    from kvbench.runtime.serving.engine import Engine

    model = tiny_model("llama", seed=3)
    prompts = [[5, 9, 3] * 20, [7, 1] * 70]
    fast = Engine(model, block_size=4, num_blocks=3000)
    ref = Engine(model, block_size=4, num_blocks=3000, attention_backend="torch")
    assert fast.attention_backend == "cpu" and ref.attention_backend == "torch"
    a = fast.generate(prompts, max_new_tokens=24)
    b = ref.generate(prompts, max_new_tokens=24)
    assert [g.token_ids for g in a] == [g.token_ids for g in b]


def test_rms_norm_and_rotary_match_torch():
    from kvbench.runtime.model.forward import rms_norm
    from kvbench.runtime.model.rope import apply_rotary

    torch.manual_seed(1)
    for rows in (1, 7, 300):  # 300 rows take the multi-threaded branch
        x, w = torch.randn(rows, 96) * 3, torch.randn(96)
        torch.testing.assert_close(cpu_kernels.rms_norm(x, w, 1e-6), rms_norm(x, w, 1e-6), atol=1e-5, rtol=1e-5)
        heads, D = 5, 16
        qkv = torch.randn(rows, (heads + 2) * D)  # two trailing heads (v) must stay untouched
        cos, sin = torch.randn(rows, D), torch.randn(rows, D)
        ref = apply_rotary(qkv[:, : heads * D].view(rows, heads, D), cos[:, None], sin[:, None])
        got = qkv.clone()
        cpu_kernels.rotary_(got, heads, D, cos, sin)
        torch.testing.assert_close(got[:, : heads * D].view(rows, heads, D), ref, atol=1e-6, rtol=1e-6)
        assert torch.equal(got[:, heads * D:], qkv[:, heads * D:])


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_model_with_and_without_kernels(family):
    """The same model through the C kernels and through plain torch ops gives the same log-probs."""
    from kvbench.runtime.serving.engine import Engine
    from kvbench.runtime.serving.scoring import Scorer

    model = tiny_model(family, seed=4)
    assert model.use_cpu_kernels
    ids = torch.randint(0, 300, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    fast = Scorer(Engine(model, block_size=8, num_blocks=2000)).score(ids, chunk_size=64)
    model.use_cpu_kernels = False
    ref = Scorer(Engine(model, block_size=8, num_blocks=2000, attention_backend="torch")).score(ids, chunk_size=64)
    torch.testing.assert_close(fast, ref, atol=1e-4, rtol=1e-4)



@pytest.mark.parametrize("group,head_dim", [(1, 64), (3, 64), (8, 64), (4, 128), (9, 64), (2, 96)])
def test_kernel_specialisations_match_reference(group, head_dim):
    """Groups of 1..8 with head dims 64/128 take the register-resident kernel; others the generic one."""
    cache, slots = filled_cache([77, 300], H=2, D=head_dim)
    q = torch.randn(2, 2 * group, 1, head_dim)
    (ref, ref_ks), (out, ks) = both(cache, slots, 0, q)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ks, ref_ks, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("rows,bias", [(1, False), (2, True), (3, True), (4, False), (5, True), (7, False), (12, True),
                                       (16, True), (17, False)])
def test_decode_projection_gemv_matches_torch(rows, bias):
    from kvbench.runtime.backends.cpu.linear import Linear

    torch.manual_seed(rows)
    w = torch.randn(300, 96)
    b = torch.randn(300) if bias else None
    lin = Linear(w, b)
    assert (lin._plain is not None) == (lin.backend == "onednn")  # the C path exists wherever oneDNN packs fp32
    x = torch.randn(rows, 1, 96)
    with torch.inference_mode():
        y = lin(x)
    assert y.shape == (rows, 1, 300)
    torch.testing.assert_close(y, torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-4)
    if lin._plain is not None and rows <= cpu_kernels.GEMV_MAX_ROWS:  # the C kernel alone gives the same numbers
        torch.testing.assert_close(cpu_kernels.gemv(x, w, b), torch.nn.functional.linear(x, w, b), rtol=1e-5,
                                   atol=1e-4)


def test_gemv_rows_do_not_depend_on_the_batch_they_are_in():
    """From two rows up, a row's GEMV result is bit for bit the same in any batch: the register tile (4 x 2 on
    AVX2, 8 x 3 on AVX-512) gives every output the same FMA order, and rows past the tile (300 = 37 x 8 + 4 outputs)
    take the same one-row loop. So a sequence decodes alike in a batch of 2 or of 16."""
    if not cpu_kernels.available():
        pytest.skip("no C kernels here")
    torch.manual_seed(1)
    w, b = torch.randn(300, 96), torch.randn(300)
    x = torch.randn(16, 96)
    full = cpu_kernels.gemv(x, w, b)
    for m in (2, 3, 5, 8, 11, 13):
        assert torch.equal(cpu_kernels.gemv(x[:m], w, b), full[:m]), m
    assert torch.equal(cpu_kernels.gemv(x[5:7], w, b), full[5:7])


def test_a_decode_step_takes_the_gemv_up_to_sixteen_rows_and_a_chunk_keeps_onednn(monkeypatch):
    """Linear(x, gemv_rows=GEMV_MAX_ROWS) (the model's pure decode steps) runs the C GEMV for 12 rows; without it
    (prefill chunks, ragged steps) 12 rows take oneDNN, so a chunk alone and inside a ragged step agree."""
    from kvbench.runtime.backends.cpu.linear import Linear

    torch.manual_seed(0)
    w, b = torch.randn(300, 96), torch.randn(300)
    lin = Linear(w, b)
    if lin._plain is None:
        pytest.skip("no oneDNN / C kernels here")
    calls = []
    real = cpu_kernels.gemv
    monkeypatch.setattr(cpu_kernels, "gemv", lambda *a: calls.append(a[0].shape) or real(*a))
    x = torch.randn(12, 96)
    with torch.inference_mode():
        chunk = lin(x)
        assert calls == []  # more than LINEAR_GEMV_MAX_ROWS rows: oneDNN
        decode = lin(x, cpu_kernels.GEMV_MAX_ROWS)
        assert calls == [(12, 96)]
        lin(torch.randn(cpu_kernels.GEMV_MAX_ROWS + 1, 96), cpu_kernels.GEMV_MAX_ROWS)
        assert len(calls) == 1  # above GEMV_MAX_ROWS: oneDNN again
    ref = torch.nn.functional.linear(x, w, b)
    torch.testing.assert_close(decode, ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(chunk, ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("V", [1, 7, 16, 33, 49152])
def test_argmax_rows_is_torchs_argmax(V):
    """Greedy sampling's C argmax picks what torch's does: the first of tied maxima, the first NaN, -inf rows,
    maxima in the vector body and in the tail."""
    g = torch.Generator().manual_seed(V)
    x = torch.randn(9, V, generator=g)
    x[1] = 3.0  # all tied: the first
    x[2] = float("-inf")
    x[3, V // 2] = float("nan")
    x[3, -1] = float("nan")
    x[4, -1] = 100.0  # in the tail
    x[5, V // 3] = float("inf")
    x[6, 0] = float("nan")
    x[7] = x[7].round()  # many ties at the maximum
    x[8, :] = -5.0
    x[8, V - 1] = -4.0
    assert cpu_kernels.argmax_rows(x) == x.argmax(-1).tolist()
    assert cpu_kernels.argmax_rows(x[3:4]) == [x[3].argmax().item()]
    assert cpu_kernels.argmax_rows(x.double()) is None  # not fp32: the caller keeps torch's


def test_installed_package_ships_every_kernel_source():
    """pyproject's package-data must carry every file the kernel build reads (a wheel without decode_common.h
    compiles nothing and falls back to the slow path)."""
    import fnmatch
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    root = Path(cpu_kernels.__file__).resolve().parents[4]
    pyproject = root / "pyproject.toml"
    if not pyproject.exists():
        pytest.skip("not a checkout")
    package_data = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["package-data"]
    patterns = package_data["kvbench.runtime.backends.cpu"]
    package_dir = Path(cpu_kernels.__file__).parent
    for path in cpu_kernels._SOURCES + cpu_kernels._HEADERS:
        rel = path.relative_to(package_dir).as_posix()
        assert any(fnmatch.fnmatch(rel, p) for p in patterns), f"{rel} is not in package-data {patterns}"


OTHER_WIDTH_FILES = ("test_cpu_kernels.py", "test_codec_decode_kernel.py", "test_codec_prefill_kernel.py",
                     "test_fused_decode.py")


@pytest.mark.parametrize("files", [OTHER_WIDTH_FILES[:1], pytest.param(OTHER_WIDTH_FILES, marks=pytest.mark.slow)],
                         ids=["kernels", "kernels-codecs-fused"])
def test_kernel_tests_pass_at_the_other_vector_width(files):
    """The kernels' vector code has an 8-float (AVX2) and a 16-float (AVX-512) form, picked by the machine: build
    the one this machine does not pick and run the kernel tests against it, so both are checked on any machine
    (the attention and matmul kernels by default; the codec and fused-decode kernels too under `make test-all`)."""
    import subprocess
    import sys
    from pathlib import Path

    native = cpu_kernels.vector_width()
    assert native in (8, 16)
    other = "16" if native == 8 else "8"
    tests = Path(__file__).parent
    env = {**os.environ, "KVBENCH_CPU_KERNEL_VECTOR": other}
    files = [str(tests / f) for f in files]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *files,
                           "-k", "not vector_width"], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout.strip().splitlines()[-1]
    check = subprocess.run([sys.executable, "-c", "from kvbench.runtime.backends.cpu import kernels as c; "
                            "print(c.vector_width())"], env=env, capture_output=True, text=True, timeout=300)
    assert check.stdout.strip() == other, check.stderr[-2000:]


def test_bad_vector_width_is_named(monkeypatch):
    monkeypatch.setenv("KVBENCH_CPU_KERNEL_VECTOR", "12")
    with pytest.raises(RuntimeError, match="KVBENCH_CPU_KERNEL_VECTOR='12': valid values are 8, 16"):
        cpu_kernels._flags()

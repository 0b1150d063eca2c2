"""Small C kernels for the CPU decode path (csrc/), loaded with ctypes.

- ``paged_decode_attention``: one query token per sequence against its cached K/V, read in place
  through the block tables (no gather, no copy of cached K/V). Each (sequence, kv-head) is split
  into chunks of keys so both cores work even at batch 1; chunks are merged with their softmax
  statistics (flash-decoding). It also returns per-key attention mass for score-based methods.
- ``codec_decode_attention``: the same over a codec cache (KIVI 2/4/8-bit, int8, NVFP4, MXFP4): each packed or fp16
  block is decoded into an fp32 tile in L1 as the kernel reaches it, instead of dequantizing the layer into a dense
  copy first (what the torch path of QuantizedPagedKVCache does).
- ``codec_prefill_attention``: a causal chunk of queries (prefill) over a codec cache, block by block through the
  same tiles, with an online softmax per query; no dense copy of the layer either.
- ``gemv``: a decode step's projections (a few rows against the weight in transformers' [out, in] layout).
- ``rms_norm`` and ``rotary_``: row-wise ops where torch's dispatch of several small kernels per
  token costs more than the arithmetic once the weight GEMVs have flushed the caches.
- ``decode_layers``: whole decoder layers of a decode step (norms, projections, RoPE, the K/V write, attention,
  MLP) in one OpenMP parallel region (csrc/decode_layer.c); fused_decode.py decides when it applies.

The torch reference (``paged_attention_torch``) gathers a sequence's blocks before attending; at
decode time on CPU that copy and MKL's small-matrix products cost more than the attention itself.
Every kernel is checked against its torch counterpart in tests/runtime/test_cpu_kernels.py. `backend.CpuBackend` is
what the model and the caches call; this module is the ctypes layer under it.

The library is compiled on first use with the system C compiler (``$CC`` or ``cc``, with OpenMP)
into ``$KVBENCH_CACHE_DIR/ext`` (default ``~/.cache/kvbench/ext``), keyed by the sources, flags and
CPU. A cached library is loaded only if it and that folder belong to the user and no one else can write them;
else it is rebuilt in a private temporary folder, with a warning. Without a compiler, or with
``KVBENCH_CPU_KERNEL=0``, callers use the torch paths.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path
from typing import Callable

import torch

from kvbench import atomic_write
from kvbench.console import say, warn
from kvbench.runtime.backends.torch.attention import paged_attention_torch
from kvbench.runtime.measured_times import quoted

log = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [_CSRC / name for name in ("paged_decode.c", "codec_decode.c", "decode_ops.c", "decode_layer.c",
                                            "page_select.c")]
_HEADERS = [_CSRC / name for name in ("decode_common.h", "decode_ops.h")]
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-std=gnu11", "-shared", "-fPIC"]
ITEMS_PER_THREAD = 2  # work items (sequence, kv-head, chunk of keys) per thread: fewer chunks run faster,
# but a batch of one needs its heads split for every core to have work
_MAX_GROUP = 64  # MAX_G in the C source
_lib = None
_kernel_error: str | None = None
KERNELS_DISABLED = "disabled by KVBENCH_CPU_KERNEL=0"


def _cache_dir() -> Path:
    root = os.environ.get("KVBENCH_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kvbench")
    return Path(root) / "ext"


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def _flags() -> list[str]:
    """The compiler flags. KVBENCH_CPU_KERNEL_VECTOR=8 or 16 (a testing knob) sets the floats per vector instead of
    the machine's register width, so both forms of the kernels' vector code can be tested on one machine; that
    build is -O1 (GCC takes a minute at -O3 for vectors wider than the registers)."""
    width = os.environ.get("KVBENCH_CPU_KERNEL_VECTOR")
    if width in (None, ""):
        return _FLAGS
    if width not in ("8", "16"):
        raise RuntimeError(f"KVBENCH_CPU_KERNEL_VECTOR={width!r}: valid values are 8, 16 (unset: native width)")
    return [("-O1" if f == "-O3" else f) for f in _FLAGS] + [f"-DKVBENCH_VN={width}"]


def _library_path(sources: list[Path] | None = None, headers: list[Path] | None = None,
                  flags: list[str] | None = None, stem: str = "kvbench_cpu") -> Path:
    """Where the library for these sources, flags and CPU is cached: $KVBENCH_CACHE_DIR/ext/<stem>-<key>.so
    (default: the decode kernels; quant_linear.py builds its own library through the same functions)."""
    cc = os.environ.get("CC", "cc")
    src = b"".join(p.read_bytes() for p in (sources or _SOURCES) + (headers or _HEADERS))
    flags = _flags() if flags is None else flags
    key = hashlib.sha256(src + " ".join([cc, *flags]).encode() + _cpu_signature().encode()).hexdigest()[:16]
    return _cache_dir() / f"{stem}-{key}.so"


def untrusted(path: Path) -> str | None:
    """Why a cached library (or its folder) must not be loaded, or None when it may: only a file or folder of this
    user's, not a symbolic link, and writable by no one else (anyone who can write it could run code in kvbench)."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        return f"cannot be checked ({exc.strerror or exc})"
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if st.st_uid != os.getuid():
        return f"is owned by uid {st.st_uid}, not by this user ({os.getuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return "is writable by group or others"
    return None


def untrusted_above(folder: Path) -> str | None:
    """Why a folder above the cache (its real path's ancestors: $KVBENCH_CACHE_DIR, ~/.cache, ...) makes the cache
    unsafe, or None: each must be this user's or root's and writable by no one else, unless sticky (/tmp), since
    whoever can write a folder above ext/ can rename it and put another library in its place."""
    for parent in Path(os.path.realpath(folder)).parents:
        try:
            st = os.stat(parent)
        except OSError as exc:
            return f"{parent} cannot be checked ({exc.strerror or exc})"
        if st.st_uid not in (0, os.getuid()):
            return f"{parent} is owned by uid {st.st_uid}, not by this user ({os.getuid()}) or root"
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
            return f"{parent} is writable by group or others"
    return None


def _compile(sources: list[Path] | None = None, headers: list[Path] | None = None, flags: list[str] | None = None,
             stem: str = "kvbench_cpu") -> tuple[Path, Path | None]:
    """(the library to load, a private folder to delete once it is loaded, or None). A cached library is used only
    if it and its folder pass `untrusted` and the folders above pass `untrusted_above`; otherwise the kernels are
    built into a fresh private folder, with a
    warning, and that folder is deleted after loading (the loaded library stays mapped)."""
    out = _library_path(sources, headers, flags, stem)
    folder = out.parent
    why = untrusted_above(folder)  # the folders above ext/ too: a writable cache root can swap ext/ for another
    if why is None and os.path.lexists(folder):
        why = untrusted(folder) and f"{folder} {untrusted(folder)}"
        if why is None and os.path.lexists(out):
            why = untrusted(out) and f"{out} {untrusted(out)}"
    if why is not None:
        warn(f"not loading the cached CPU kernels: {why}; building them in a private folder for this run instead "
             f"(fix it: remove {folder} or make it yours and not group/world-writable)")
        private = Path(tempfile.mkdtemp(prefix="kvbench-ext-"))  # mode 0700, this user's
        try:
            return _build(private / out.name, sources, flags), private
        except BaseException:
            shutil.rmtree(private, ignore_errors=True)
            raise
    if out.exists():
        return out, None
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    return _build(out, sources, flags), None


def _build(out: Path, sources: list[Path] | None = None, flags: list[str] | None = None) -> Path:
    """Compile the sources into `out` (through a temp file in its folder, renamed: concurrent builders never load
    a half-written library); a file no one else may write."""
    cc = os.environ.get("CC", "cc")
    took = quoted("compile")
    say(f"kvbench: compiling the CPU kernels into {out.parent} (once per machine and kernel version"
        + (f"; {took}" if took else "") + ")")
    try:
        # mode 0755: the linker's mode follows the umask; the library is never group/world-writable
        with atomic_write.replaced(out, mode=0o755) as tmp:
            subprocess.run([cc, *(_flags() if flags is None else flags), *map(str, sources or _SOURCES), "-o", tmp,
                            "-lm"], check=True, capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError) as err:
        detail = err.stderr.strip()[:500] if isinstance(err, subprocess.CalledProcessError) else str(err)
        raise RuntimeError(f"{cc} failed: {detail}") from err
    return out


def open_library(sources: list[Path] | None = None, headers: list[Path] | None = None,
                 flags: list[str] | None = None, stem: str = "kvbench_cpu") -> ctypes.CDLL:
    """Compile (cached per machine, `_compile`) and load one kernel library; every CPU kernel library is opened
    here. Raises OSError or RuntimeError with the reason, also when KVBENCH_CPU_KERNEL=0 disables them all: each
    loader keeps its library, or that reason, for the rest of the process."""
    if os.environ.get("KVBENCH_CPU_KERNEL", "1") == "0":
        raise RuntimeError(KERNELS_DISABLED)
    path, private = _compile(sources, headers, flags, stem)
    try:  # torch ships libgomp.so.1; the library links the same soname, so it shares torch's OpenMP runtime
        return ctypes.CDLL(str(path))
    finally:
        if private is not None:
            shutil.rmtree(private, ignore_errors=True)


def load_kernel():
    """The compiled library, or None (the reason is in ``kernel_error()``). Built once per process."""
    global _lib, _kernel_error
    if _lib is not None or _kernel_error is not None:
        return _lib
    try:
        lib = open_library()
    except (OSError, RuntimeError) as err:
        _kernel_error = str(err)
        if _kernel_error != KERNELS_DISABLED:
            log.warning("CPU kernels unavailable (%s); using the torch paths", err)
        return None
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    lib.paged_decode_attention_f32.argtypes = [p, p, p, p, i64, i64, i64, p, i64, i64, i32, i32, i32, i32, i32,
                                               f32, i64, i32, p, p, p, p, i32]
    lib.rms_norm_f32.argtypes = [p, p, p, i64, i64, f32, i32]
    lib.rotary_f32.argtypes = [p, i64, i64, i64, i64, p, p, i32]
    lib.gemv_f32.argtypes = [p, p, p, p, i64, i64, i64, i32]
    for fn in (lib.paged_decode_attention_f32, lib.rms_norm_f32, lib.rotary_f32, lib.gemv_f32):
        fn.restype = None
    lib.decode_layers_f32.argtypes = [p, i64, i64, i64, p, i32, f32, p, p, p, p, p, i64,
                                      p, i64, i64, i64, i64, p, i64, i64, i64, i32, i32, i32, i32, f32, i64, i32,
                                      p, p, p, p, p, p, p, p, p, p, i32]
    lib.decode_layers_f32.restype = None
    lib.set_quant_matmul.argtypes, lib.set_quant_matmul.restype = [p], None
    fmt = ctypes.POINTER(BlockFormat)
    lib.codec_decode_attention_f32.argtypes = [p, p, p, i32, p, p, fmt, fmt, i64, p, i64, i64, i64, p, i64, i64,
                                               i32, i32, i32, i32, i32, f32, i64, i32, p, p, p, p, p, i32]
    lib.codec_decode_attention_f32.restype = i32
    lib.codec_prefill_attention_f32.argtypes = [p, p, p, i32, p, p, fmt, fmt, i64, p, i64, i64, i64, p, i64, i64,
                                                p, i64, i64, i64, p, i32, i32, i32, i32, i32, i32, f32, p, p, i64,
                                                i32]
    lib.codec_prefill_attention_f32.restype = i32
    lib.argmax_rows_f32.argtypes, lib.argmax_rows_f32.restype = [p, i64, i64, p, i32], None
    lib.vector_width.argtypes, lib.vector_width.restype = [], i32
    lib.set_phase_clock.argtypes, lib.set_phase_clock.restype = [p], None
    lib.phase_count.argtypes, lib.phase_count.restype = [], i32
    lib.page_select_team.argtypes = [p, i64, p, p, i64, i64, i64, p, i64, i64, i32, i32, i32, i32, i32, i32, p, p]
    lib.page_select_team.restype = None
    _lib = lib
    return lib


def available() -> bool:
    return load_kernel() is not None


def vector_width() -> int | None:
    """Floats per vector register the kernels were built for (8: AVX2 and others, 16: AVX-512), or None."""
    lib = load_kernel()
    return lib.vector_width() if lib is not None else None


DECODE_PHASES = ("norm_attn", "qkv", "rope_write", "page_select", "attention", "o_proj", "norm_mlp", "gate_up", "down")


class PhaseClock:
    """Wall seconds per phase of the fused decode layers (csrc/decode_layer.c), summed over layers and calls while
    the clock is on (`with PhaseClock() as clock: ...`; then `clock.seconds()`); one clock at a time, for
    profiling (bench/profile_decode.py)."""

    def __init__(self):
        self._acc = (ctypes.c_double * len(DECODE_PHASES))()

    def __enter__(self) -> "PhaseClock":
        lib = load_kernel()
        assert lib is not None and lib.phase_count() == len(DECODE_PHASES)
        lib.set_phase_clock(ctypes.addressof(self._acc))
        return self

    def __exit__(self, *exc) -> None:
        _lib.set_phase_clock(None)

    def seconds(self) -> dict[str, float]:
        return dict(zip(DECODE_PHASES, list(self._acc)))


def kernel_error() -> str | None:
    return _kernel_error


def _decode_call(q: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor):
    """The library and (S, H, G, D) of a decode-attention call: q [S, H*G, 1, D], tables [S, H, MB] int32,
    lengths [S, H] int64."""
    lib = load_kernel()
    if lib is None:
        raise RuntimeError(f"CPU kernels unavailable: {_kernel_error}")
    S, Hq, Q, D = q.shape
    H = tables.shape[1]
    assert Q == 1 and tables.dtype == torch.int32 and lengths.dtype == torch.int64
    return lib, S, H, Hq // H, D


class _DecodeBuffers:
    """The work split and the outputs / scratch of one decode-attention call (both kernels): chunks of `chunk` key
    slots (a multiple of `min_chunk`; about ITEMS_PER_THREAD work items per thread), T padded to Tp,
    out [S, Hq, 1, D], scores [S, H, G, Tp], partials [S, H, Tp / chunk, G, D + 2], key_scores [S, H, Tp]."""

    def __init__(self, S: int, H: int, G: int, D: int, T: int, min_chunk: int, key_scores: bool):
        self.threads = torch.get_num_threads()
        chunks_per_table = -(-ITEMS_PER_THREAD * self.threads // (S * H))
        chunk = max(min_chunk, -(-T // chunks_per_table))
        self.chunk = -(-chunk // min_chunk) * min_chunk
        self.Tp = max(1, -(-T // self.chunk)) * self.chunk
        self.T = T
        self.out = torch.empty(S, H * G, 1, D, dtype=torch.float32)
        self.scores = torch.empty(S, H, G, self.Tp, dtype=torch.float32)
        self.partials = torch.empty(S, H, self.Tp // self.chunk, G, D + 2, dtype=torch.float32)
        self.key_scores = torch.empty(S, H, self.Tp, dtype=torch.float32) if key_scores else None

    def key_scores_ptr(self) -> int | None:
        return self.key_scores.data_ptr() if self.key_scores is not None else None

    def result(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.out, (self.key_scores[:, :, : self.T] if self.key_scores is not None else None)


def paged_decode_attention_cpu(
    q: torch.Tensor,  # [S, Hq, 1, D] fp32
    k_pool: torch.Tensor,  # [N, bs, D] fp32 contiguous
    v_pool: torch.Tensor,
    tables: torch.Tensor,  # [S, H, MB] int32
    lengths: torch.Tensor,  # [S, H] int64
    scale: float,
    *,
    return_key_scores: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Decode attention read in place from the pool: (out [S, Hq, 1, D], key_scores [S, H, T] or None).
    A head with no cached keys gives zeros (the torch reference gives NaN there; the Triton kernel zeros)."""
    lib, S, H, G, D = _decode_call(q, tables, lengths)
    bs = k_pool.shape[1]
    assert G <= _MAX_GROUP and q.dtype == k_pool.dtype == v_pool.dtype == torch.float32
    assert k_pool.is_contiguous() and v_pool.is_contiguous() and k_pool.shape[-1] == D
    b = _DecodeBuffers(S, H, G, D, int(lengths.max()), 16, return_key_scores)
    q = q.contiguous()
    ts, ls = tables.stride(), lengths.stride()
    lib.paged_decode_attention_f32(q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(),
                                   tables.data_ptr(), ts[0], ts[1], ts[2], lengths.data_ptr(), ls[0], ls[1],
                                   S, H, G, D, bs, scale, b.Tp, b.chunk, b.out.data_ptr(), b.key_scores_ptr(),
                                   b.scores.data_ptr(), b.partials.data_ptr(), b.threads)
    return b.result()


class BlockFormat(ctypes.Structure):
    """How the C kernel reads one packed K or V row (`block_format` in csrc/decode_ops.h)."""

    _fields_ = [("row_bytes", ctypes.c_int64), ("codes_off", ctypes.c_int64), ("mn_off", ctypes.c_int64),
                ("scale_off", ctypes.c_int64), ("bits", ctypes.c_int32), ("is_signed", ctypes.c_int32),
                ("per_channel", ctypes.c_int32), ("group", ctypes.c_int32), ("fp4", ctypes.c_int32),
                ("reserved", ctypes.c_int32), ("tscale_off", ctypes.c_int64)]


class CodecPools(ctypes.Structure):
    """A codec cache's pools as the fused decode step's codec attention reads them (`codec_pools` in
    csrc/decode_ops.h). `of` keeps the tensors and formats it points to alive on the instance."""

    _fields_ = [("k_fp", ctypes.c_void_p), ("v_fp", ctypes.c_void_p), ("fp_is_half", ctypes.c_int32),
                ("kq", ctypes.c_void_p), ("vq", ctypes.c_void_p), ("kf", ctypes.POINTER(BlockFormat)),
                ("vf", ctypes.POINTER(BlockFormat)), ("num_fp", ctypes.c_int64), ("tiles", ctypes.c_void_p)]

    @classmethod
    def of(cls, cache, formats: tuple[BlockFormat, BlockFormat], threads: int) -> "CodecPools":
        """The pools of a codec cache (fp16 or fp32 full-precision blocks, contiguous pools) and `threads` scratch
        tiles."""
        k_fp, v_fp, kq, vq = cache.k_pool, cache.v_pool, cache.kq_pool, cache.vq_pool
        assert k_fp.dtype == v_fp.dtype in (torch.float16, torch.float32) and kq.dtype == vq.dtype == torch.uint8
        assert all(t.is_contiguous() for t in (k_fp, v_fp, kq, vq))
        tiles = torch.empty(threads, k_fp.shape[1], k_fp.shape[2], dtype=torch.float32)
        pools = cls(k_fp.data_ptr(), v_fp.data_ptr(), int(k_fp.dtype == torch.float16), kq.data_ptr(), vq.data_ptr(),
                    ctypes.pointer(formats[0]), ctypes.pointer(formats[1]), k_fp.shape[0], tiles.data_ptr())
        pools._keep = (k_fp, v_fp, kq, vq, formats, tiles)
        return pools


def codec_block_format(codec, kind: str, block_size: int, head_dim: int) -> BlockFormat | None:
    """The kernel's reading of a codec's packed `kind` ("key" / "value") rows, or None when the kernel cannot
    read them: the codec does not list "cpu_attention" in its `kernels` (KVQuant's non-uniform levels and
    outliers, fp8), or a head dim other than 64 / 128."""
    if head_dim not in (64, 128) or "cpu_attention" not in getattr(codec, "kernels", ()):
        return None
    if hasattr(codec, "fp4_rows"):  # FP4 (NVFP4, MXFP4): E2M1 codes, a scale byte per group of a token
        f = codec.fp4_rows(kind, block_size, head_dim)
        return BlockFormat(f.row_bytes, f.codes_offset, -1, f.scale_offset, 4, 0, 0, f.group,
                           1 if f.scale_format == "e4m3" else 2, 0, f.tensor_scale_offset)
    rows = codec.affine_rows(kind, block_size, head_dim)
    return BlockFormat(rows.row_bytes, rows.codes_offset, rows.mn_offset, rows.scale_offset, rows.bits,
                       int(rows.signed), int(rows.per_channel), rows.group, 0, 0, -1)


def codec_decode_attention_cpu(
    q: torch.Tensor,  # [S, Hq, 1, D] fp32
    k_fp: torch.Tensor,  # [num_fp, bs, D] fp16 or fp32, contiguous (same for v_fp)
    v_fp: torch.Tensor,
    kq: torch.Tensor,  # [num_packed, key row bytes] uint8, contiguous
    vq: torch.Tensor,  # [num_packed, value row bytes] uint8, contiguous
    formats: tuple[BlockFormat, BlockFormat],  # key, value (codec_block_format)
    tables: torch.Tensor,  # [S, H, MB] int32: ids < k_fp.shape[0] full precision, the rest packed
    lengths: torch.Tensor,  # [S, H] int64
    scale: float,
    *,
    return_key_scores: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Decode attention over a codec cache's two pools, read in place: (out [S, Hq, 1, D], key_scores [S, H, T]
    or None), as ``paged_decode_attention_cpu`` returns them for the dequantized blocks."""
    lib, S, H, G, D = _decode_call(q, tables, lengths)
    bs = k_fp.shape[1]
    assert q.dtype == torch.float32 and k_fp.dtype == v_fp.dtype in (torch.float16, torch.float32)
    assert k_fp.is_contiguous() and v_fp.is_contiguous() and kq.is_contiguous() and vq.is_contiguous()
    b = _DecodeBuffers(S, H, G, D, int(lengths.max()), bs, return_key_scores)  # whole blocks per work item
    q = q.contiguous()
    tiles = torch.empty(b.threads, bs, D, dtype=torch.float32)
    ts, ls = tables.stride(), lengths.stride()
    rc = lib.codec_decode_attention_f32(
        q.data_ptr(), k_fp.data_ptr(), v_fp.data_ptr(), int(k_fp.dtype == torch.float16), kq.data_ptr(),
        vq.data_ptr(), ctypes.byref(formats[0]), ctypes.byref(formats[1]), k_fp.shape[0],
        tables.data_ptr(), ts[0], ts[1], ts[2], lengths.data_ptr(), ls[0], ls[1], S, H, G, D, bs, scale, b.Tp,
        b.chunk, b.out.data_ptr(), b.key_scores_ptr(), b.scores.data_ptr(), b.partials.data_ptr(), tiles.data_ptr(),
        b.threads)
    if rc != 0:
        raise ValueError(f"codec_decode_attention: unsupported shape (head dim {D}, {G} query heads per kv head)")
    return b.result()


_NO_PACKED = torch.zeros(1, 1, dtype=torch.uint8)  # a full-precision pool has no packed rows: never read
_FP_ONLY = (BlockFormat(), BlockFormat())  # nor their formats (every block id is below the pool's size)
PREFILL_QT = 128  # queries per work item of codec_prefill_attention (PREFILL_QT in csrc/codec_decode.c)


def codec_prefill_attention_cpu(
    q: torch.Tensor,  # [S, Hq, Q, D] fp32
    k_fp: torch.Tensor,  # [num_fp, bs, D] fp16 or fp32, contiguous (same for v_fp)
    v_fp: torch.Tensor,
    kq: torch.Tensor,  # [num_packed, key row bytes] uint8, contiguous
    vq: torch.Tensor,  # [num_packed, value row bytes] uint8, contiguous
    formats: tuple[BlockFormat, BlockFormat],  # key, value (codec_block_format)
    tables: torch.Tensor,  # [S, H, MB] int32: ids < k_fp.shape[0] full precision, the rest packed
    lengths: torch.Tensor,  # [S, H] int64
    key_positions: torch.Tensor,  # [S, H, P] int32 (P >= every length)
    query_positions: torch.Tensor,  # [S, Q] int64
    scale: float,
) -> torch.Tensor:
    """Causal attention of a chunk of queries over a codec cache's two pools, read block by block into small fp32
    tiles (no dense dequantized copy of the layer): out [S, Hq, Q, D], as ``paged_attention_torch`` gives it over
    the dequantized blocks (query i sees the cached keys at positions <= its own). Per-key attention mass is not
    computed (callers that need it take the dequantize-then-attend path)."""
    lib = load_kernel()
    if lib is None:
        raise RuntimeError(f"CPU kernels unavailable: {_kernel_error}")
    S, Hq, Q, D = q.shape
    H = tables.shape[1]
    G = Hq // H
    bs = k_fp.shape[1]
    assert q.dtype == torch.float32 and k_fp.dtype == v_fp.dtype in (torch.float16, torch.float32)
    assert tables.dtype == torch.int32 and lengths.dtype == torch.int64 and key_positions.dtype == torch.int32
    assert k_fp.is_contiguous() and v_fp.is_contiguous() and kq.is_contiguous() and vq.is_contiguous()
    q = q.contiguous()
    qpos = query_positions.to(torch.int64).contiguous()
    out = torch.empty(S, Hq, Q, D, dtype=torch.float32)
    threads = torch.get_num_threads()
    rows = G * min(Q, PREFILL_QT)
    span = bs if bs >= 32 else -(-32 // bs) * bs  # keys per step of a work item (prefill_span in the C source)
    bsp = -(-span // 16) * 16  # rounded up to whole vectors (16 covers both widths)
    # K and V rows, K transposed, m and l, accumulators, the scores of a register tile of queries
    per_thread = 2 * span * D + D * bsp + 2 * rows + rows * D + 8 * bsp  # p: PF_QR (<= 8) rows of scores
    scratch = torch.empty(threads, per_thread, dtype=torch.float32)
    ts, ls, ps = tables.stride(), lengths.stride(), key_positions.stride()
    rc = lib.codec_prefill_attention_f32(
        q.data_ptr(), k_fp.data_ptr(), v_fp.data_ptr(), int(k_fp.dtype == torch.float16), kq.data_ptr(),
        vq.data_ptr(), ctypes.byref(formats[0]), ctypes.byref(formats[1]), k_fp.shape[0],
        tables.data_ptr(), ts[0], ts[1], ts[2], lengths.data_ptr(), ls[0], ls[1],
        key_positions.data_ptr(), ps[0], ps[1], ps[2], qpos.data_ptr(), S, H, G, Q, D, bs, scale, out.data_ptr(),
        scratch.data_ptr(), per_thread, threads)
    if rc != 0:
        raise ValueError(f"codec_prefill_attention: unsupported shape (head dim {D})")
    return out


def paged_attention_cpu(q, k_pool, v_pool, tables, lengths, key_positions, query_positions, scale, *,
                        return_key_scores: bool = False, rotate_keys: Callable | None = None,
                        causal: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``paged_attention_torch``'s signature; decode steps (one query, no causal mask, keys after RoPE,
    fp32) run the C decode kernel, causal chunks over keys cached before them (chunked prefill's later chunks, fp32,
    no per-key mass) the C prefill kernel, which reads blocks in place instead of gathering the layer; everything
    else, a sequence's first chunk included (SDPA's causal path), the torch reference."""
    if (causal and not return_key_scores and rotate_keys is None and q.shape[2] > 1 and q.shape[-1] in (64, 128)
            and q.dtype == torch.float32 and k_pool.dtype == torch.float32 and k_pool.device.type == "cpu"
            and k_pool.is_contiguous() and v_pool.is_contiguous() and tables.dtype == torch.int32
            and lengths.dtype == torch.int64 and key_positions.dtype == torch.int32
            and int(lengths.max()) > q.shape[2] and load_kernel() is not None):
        return codec_prefill_attention_cpu(q, k_pool, v_pool, _NO_PACKED, _NO_PACKED, _FP_ONLY, tables, lengths,
                                           key_positions, query_positions, scale), None
    if (not causal and q.shape[2] == 1 and rotate_keys is None and q.dtype == torch.float32
            and k_pool.dtype == torch.float32 and k_pool.device.type == "cpu" and k_pool.is_contiguous()
            and v_pool.is_contiguous() and tables.dtype == torch.int32 and lengths.dtype == torch.int64
            and q.shape[1] // tables.shape[1] <= _MAX_GROUP and load_kernel() is not None):
        return paged_decode_attention_cpu(q, k_pool, v_pool, tables, lengths, scale,
                                          return_key_scores=return_key_scores)
    return paged_attention_torch(q, k_pool, v_pool, tables, lengths, key_positions, query_positions, scale,
                                 return_key_scores=return_key_scores, rotate_keys=rotate_keys, causal=causal)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm of x [..., E] (fp32, contiguous) with weight [E]."""
    assert x.is_contiguous() and weight.is_contiguous()
    out = torch.empty_like(x)
    E = x.shape[-1]
    _lib.rms_norm_f32(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // E, E, eps,
                      torch.get_num_threads())
    return out


def rotary_(x: torch.Tensor, n_heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate in place the first n_heads heads of every row of x [rows, row_len] (fp32, rows contiguous)
    by cos/sin [rows, head_dim] (rotate-half convention)."""
    assert x.stride(-1) == 1 and cos.is_contiguous() and sin.is_contiguous() and cos.shape == (x.shape[0], head_dim)
    _lib.rotary_f32(x.data_ptr(), x.shape[0], x.stride(0), n_heads, head_dim, cos.data_ptr(), sin.data_ptr(),
                    torch.get_num_threads())


# sequences up to which a decode step runs fused (its projections through `gemv`); larger batches: op by op. The
# GEMV's register tile (4 x 2 on AVX2, 8 x 3 on AVX-512) keeps up with oneDNN to about 12-16 rows, and the fused step
# saves ~10 calls per layer (figures: docs/serving.md; `python bench/bench_gemv.py`)
GEMV_MAX_ROWS = 16
# rows up to which a Linear called op by op (codec caches, methods' unfused steps, small prefill chunks) uses `gemv`:
# above it oneDNN, as before, so a small chunk and the same rows inside a larger ragged step share oneDNN's
# arithmetic (a 2-bit codec turns a last-bit difference into a flipped code)
LINEAR_GEMV_MAX_ROWS = 4


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., I] (fp32, at most GEMV_MAX_ROWS rows) @ weight[O, I]^T (+ bias [O]) -> [..., O]."""
    assert weight.is_contiguous() and weight.dtype == x.dtype == torch.float32
    x = x.contiguous()
    O, I = weight.shape
    y = torch.empty(*x.shape[:-1], O, dtype=torch.float32)
    _lib.gemv_f32(weight.data_ptr(), x.data_ptr(), bias.data_ptr() if bias is not None else None, y.data_ptr(), O,
                  I, x.numel() // I, torch.get_num_threads())
    return y


def argmax_rows(logits: torch.Tensor) -> list[int] | None:
    """torch's logits.argmax(-1).tolist() for fp32 logits [S, V] on CPU (the first NaN, else the first maximum),
    in C (csrc/decode_ops.c: argmax_rows_f32); None when the kernels are unavailable or the tensor is not that."""
    lib = load_kernel()
    if (lib is None or logits.dim() != 2 or logits.dtype != torch.float32 or logits.device.type != "cpu"
            or logits.shape[1] == 0 or logits.requires_grad):
        return None
    x = logits.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.int64)
    lib.argmax_rows_f32(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr(), torch.get_num_threads())
    return out.tolist()


class PageSelect(ctypes.Structure):
    """Page retrieval in the fused decode step (`page_select` in csrc/decode_ops.h). `of` keeps the tensors alive on
    the instance."""

    _fields_ = [("summary", ctypes.c_void_p), ("pages", ctypes.c_void_p), ("sel_tables", ctypes.c_void_p),
                ("sel_lengths", ctypes.c_void_p), ("bounds", ctypes.c_void_p), ("chosen", ctypes.c_void_p),
                ("U", ctypes.c_int64), ("MB", ctypes.c_int64), ("T", ctypes.c_int64), ("chunk", ctypes.c_int64),
                ("scores", ctypes.c_void_p), ("partials", ctypes.c_void_p), ("per_head", ctypes.c_int64),
                ("kv_blocks", ctypes.c_void_p)]

    @classmethod
    def of(cls, summary: torch.Tensor, pages: list[int], M: int, H: int, G: int, D: int, MB: int, bs: int,
           threads: int, per_head: bool = False) -> "PageSelect":
        """Buffers for a step of M sequences whose tables span MB blocks; pages[l] top blocks per query head in
        layer l (0: dense). The attention over a selection splits U * bs slots as _DecodeBuffers would, over M * H
        tables of G query heads (the union), or M * H * G tables of one (per_head: each query head's own blocks)."""
        assert summary.dtype == torch.float16 and summary.is_contiguous()
        L = len(pages)
        tables, group = (H * G, 1) if per_head else (H, G)
        U = max(1, min((1 if per_head else G) * max(pages), MB))
        chunks_per_table = -(-ITEMS_PER_THREAD * threads // (M * tables))
        chunk = max(16, -(-U * bs // chunks_per_table))
        chunk = -(-chunk // 16) * 16
        T = -(-U * bs // chunk) * chunk
        keep = dict(summary=summary, pages=torch.tensor(pages, dtype=torch.int32),
                    sel_tables=torch.zeros(M, tables, U, dtype=torch.int32),
                    sel_lengths=torch.zeros(L, M, tables, dtype=torch.int64),
                    kv_blocks=torch.zeros(L, M, H, dtype=torch.int64),  # per_head: distinct blocks per kv-head
                    bounds=torch.empty(M, H, 2 * G, MB, dtype=torch.float32),
                    chosen=torch.empty(M, H, G, MB, dtype=torch.uint8),
                    scores=torch.empty(M, tables, group, T, dtype=torch.float32),
                    partials=torch.empty(M, tables, T // chunk, group, D + 2, dtype=torch.float32))
        ps = cls(**{k: t.data_ptr() for k, t in keep.items()}, U=U, MB=MB, T=T, chunk=chunk, per_head=int(per_head))
        ps._keep = keep
        return ps

    def at_layer(self, first: int) -> None:
        """Point `pages` and `sel_lengths` at layer `first` (a call running layers first.. reads them from 0)."""
        k = self._keep
        self.pages = k["pages"].data_ptr() + first * k["pages"].element_size()
        self.sel_lengths = k["sel_lengths"][first].data_ptr()
        self.kv_blocks = k["kv_blocks"][first].data_ptr()

    @property
    def selected_lengths(self) -> torch.Tensor:
        """[L, M, H] tokens each layer's selections held (this step; dense layers: untouched)."""
        return self._keep["sel_lengths"]

    @property
    def kv_head_blocks(self) -> torch.Tensor:
        """[L, M, H] per_head: the distinct blocks each kv-head's query heads read (this step)."""
        return self._keep["kv_blocks"]


def select_pages_c(q: torch.Tensor, summary: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor,
                   block_size: int, pages: int, per_head: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The fused step's page selection (csrc/page_select.c) run alone, on one thread: the same arguments and result
    as page_retrieval.select_pages (q [S, Hq, D] fp32, summary [N, 2, D], tables [S, H, MB] int32, lengths [S, H]),
    or with per_head as select_pages_per_head ([S, Hq, k] tables); for tests; None when the kernels are
    unavailable."""
    lib = load_kernel()
    if lib is None:
        return None
    S, Hq, D = q.shape
    H, MB = tables.shape[1], tables.shape[2]
    G = Hq // H
    ps = PageSelect.of(summary.contiguous(), [pages], S, H, G, D, MB, block_size, 1, per_head)
    qc = q.float().contiguous()
    tab = tables.to(torch.int32).contiguous()
    lens = lengths.to(torch.int64).contiguous()
    sel_len = torch.zeros(S, Hq if per_head else H, dtype=torch.int64)
    lib.page_select_team(qc.data_ptr(), Hq * D, ctypes.addressof(ps), tab.data_ptr(), H * MB, MB, 1, lens.data_ptr(), H,
                         1, S, H, G, D, block_size, pages, sel_len.data_ptr(), None)
    return ps._keep["sel_tables"].clone(), sel_len


def _pointer(t: torch.Tensor | None, dtype: torch.dtype = torch.float32) -> int | None:
    assert t is None or (t.is_contiguous() and t.dtype == dtype and t.device.type == "cpu")
    return t.data_ptr() if t is not None else None


class ProjectionPart(ctypes.Structure):
    """One matrix of a projection (`projection_part` in csrc/decode_ops.h): fp32 [rows, in] (type 0) or rows of a
    GGUF file's blocks of ggml type `type`, multiplied by the quantized kernels of instruction set `isa` with
    activations `act` (0 fp32, 1 Q8 blocks: quant_linear.ACTIVATIONS)."""

    _fields_ = [("data", ctypes.c_void_p), ("rows", ctypes.c_int64), ("row_bytes", ctypes.c_int64),
                ("type", ctypes.c_int32), ("isa", ctypes.c_int32), ("act", ctypes.c_int32),
                ("reserved", ctypes.c_int32)]


MAX_PARTS = 4  # MAX_PARTS in csrc/decode_ops.h


class Projection(ctypes.Structure):
    """A projection of the fused decode step (`projection` in csrc/decode_ops.h): its matrices stacked along the
    output, and its bias (or NULL). The caller keeps the tensors alive."""

    _fields_ = [("part", ProjectionPart * MAX_PARTS), ("n_parts", ctypes.c_int32), ("reserved", ctypes.c_int32),
                ("bias", ctypes.c_void_p)]

    @classmethod
    def fp32(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> "Projection":
        """weight [out, in] fp32 contiguous (the C GEMV)."""
        p = cls(n_parts=1, bias=_pointer(bias))
        p.part[0] = ProjectionPart(_pointer(weight), weight.shape[0], weight.shape[1] * 4, 0, 0)
        return p

    @classmethod
    def quantized(cls, parts: list[tuple[int, torch.Tensor]], isa: int, bias: torch.Tensor | None,
                  act: int = 0) -> "Projection":
        """parts: (ggml type, blocks uint8 [rows, row bytes]) stacked along the output, at most MAX_PARTS."""
        assert 1 <= len(parts) <= MAX_PARTS
        p = cls(n_parts=len(parts), bias=_pointer(bias))
        for i, (type_id, data) in enumerate(parts):
            assert type_id != 0
            p.part[i] = ProjectionPart(_pointer(data, torch.uint8), data.shape[0], data.shape[1], type_id, isa, act)
        return p


class DecodeLayerWeights(ctypes.Structure):
    """One layer's weights for ``decode_layers`` (`layer_weights` in csrc/decode_layer.c): the norms' weights and
    four projections. The caller keeps the tensors alive."""

    _fields_ = [("ln_attn", ctypes.c_void_p), ("ln_mlp", ctypes.c_void_p), ("qkv", Projection), ("o", Projection),
                ("gu", Projection), ("down", Projection)]

    @classmethod
    def of(cls, ln_attn: torch.Tensor, ln_mlp: torch.Tensor, qkv: Projection, o: Projection, gu: Projection,
           down: Projection) -> "DecodeLayerWeights":
        return cls(_pointer(ln_attn), _pointer(ln_mlp), qkv, o, gu, down)


def set_quant_matmul(fn: int) -> None:
    """Hand the decode library the quantized kernels' `quant_matmul_team` (its address: quant_linear.py's library),
    which the fused step calls for quantized projections."""
    _lib.set_quant_matmul(fn)


def decode_layers(
    x: torch.Tensor,  # [M, E] fp32 contiguous residual stream, updated in place
    weights: ctypes.Array,  # DecodeLayerWeights, one per layer
    first: int,  # layers first .. first + n - 1 run
    n: int,
    intermediate: int,
    eps: float,
    cos: torch.Tensor,  # [M, D] contiguous
    sin: torch.Tensor,
    k_pool: torch.Tensor,  # [N, bs, D] fp32 contiguous (same for v_pool; fp16 for a codec's full-precision pools)
    v_pool: torch.Tensor,
    write_rows: torch.Tensor,  # [L, M, H] int64 contiguous: flat pool row of each layer's new K/V
    tables: torch.Tensor,  # [M, L, H, MB] int32
    lengths: torch.Tensor,  # [M, L, H] int64, after this step's append
    num_heads: int,
    scale: float,
    buffers: "_DecodeBuffers",  # sized for the longest table; its `out` holds the attention output
    scratch: tuple[torch.Tensor, torch.Tensor, torch.Tensor],  # h [M, E], act [M, I], gu [M, 2I]
    codec: CodecPools | None = None,  # a codec cache: its pools (k_pool / v_pool are its full-precision pools)
    pages: PageSelect | None = None,  # page retrieval: summaries kept, retrieving layers read their selection
) -> torch.Tensor:
    """Decoder layers first..first+n-1 of a decode step in one call (csrc/decode_layer.c): x += each layer's output
    in turn, the new K/V written at write_rows, per-key attention mass into buffers.key_scores when it is set
    (n == 1 then); with `codec`, the attention reads a codec cache as codec_decode_attention_cpu does (buffers
    then in whole blocks, as that function sizes them). Returns q [M, Hq, 1, D] of the last layer after RoPE (a
    fresh tensor: a method's hook may keep it)."""
    M, E = x.shape
    H, D, bs = tables.shape[2], k_pool.shape[2], k_pool.shape[1]
    G = num_heads // H
    assert n == 1 or buffers.key_scores is None
    qkv = torch.empty(M, (num_heads + 2 * H) * D, dtype=torch.float32)
    h, act, gu = scratch
    b = buffers
    ts, ls, ws = tables.stride(), lengths.stride(), write_rows.stride()
    size = ctypes.sizeof(DecodeLayerWeights)
    if pages is not None:  # the layers of this call: their page counts and selection lengths
        pages.at_layer(first)
    _lib.decode_layers_f32(
        x.data_ptr(), M, E, intermediate, ctypes.addressof(weights) + first * size, n, eps, cos.data_ptr(),
        sin.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), write_rows[first].data_ptr(), ws[0],
        tables[:, first].data_ptr(), ts[1], ts[0], ts[2], ts[3], lengths[:, first].data_ptr(), ls[1], ls[0], ls[2],
        H, G, D, bs, scale, b.Tp, b.chunk, None if codec is None else ctypes.addressof(codec), h.data_ptr(),
        qkv.data_ptr(), b.out.data_ptr(), act.data_ptr(), gu.data_ptr(), b.key_scores_ptr(), b.scores.data_ptr(),
        b.partials.data_ptr(), None if pages is None else ctypes.addressof(pages), b.threads)
    return qkv[:, : num_heads * D].view(M, num_heads, 1, D)

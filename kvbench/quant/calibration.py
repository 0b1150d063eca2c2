"""KVQuant calibration: per-layer nuqX level sets and per-channel key thresholds from calibration text.

    cal = calibrate(model, tokenizer, CalibrationSettings(bits=3))      # cached on disk
    codec = KVQuantCodec(3, key_levels=cal.key_levels, value_levels=cal.value_levels, key_ranges=cal.key_ranges)

1. Calibration text, kept apart from evaluation text: by default the ACLSum paper bodies of the train split
   (kvbench.data.aclsum; the perplexity benchmarks evaluate on the essays). `num_sequences` papers, the first
   `seq_len` tokens of each.
2. Activations: the runtime model's own forward (`LlamaFamilyModel.forward`) over each whole sequence, with a
   capturing stand-in for the paged cache that attends densely and keeps the graph (`forward_capture`), gives
   every layer's keys before RoPE (as the KVQuant cache stores them) and values, and, for `method="fisher"`, the
   squared gradients of the next-token loss with respect to them (a diagonal Fisher information: KVQuant's
   sensitivity weights).
3. Key thresholds per (layer, kv-head, channel): the outlier_fraction/2 and 1 - outlier_fraction/2 quantiles over
   the calibration tokens (`fit_channel_ranges`), unless key_ranges="online".
4. Levels per layer (levels="nuq"): the calibration values normalized exactly as the codec will normalize them
   (`dense_normalized`: keys per channel by the thresholds, values per token by their own range, outliers left
   out) are clustered into 2**bits levels by 1-D k-means, each sample weighted by its squared gradient
   ("fisher") or equally ("kmeans", the recorded fallback).
The first block of each sequence is left out (the codec keeps it in full precision).

Results are cached under `cache_root()/kvquant/` in a file named by the model fingerprint (config + a checksum of
the weights) and every setting, so a second run with the same model, bits, corpus and settings loads in
milliseconds.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from kvbench import atomic_write
from kvbench.console import warn
from kvbench.data.aclsum import load_aclsum
from kvbench.errors import UserError, first_line
from kvbench.quant.nonuniform import dense_normalized, fit_channel_ranges, fit_nuq_levels
from kvbench.runtime.backends.cpu.linear import Linear, keep_dense_weights
from kvbench.runtime.backends.cpu.quant_linear import QuantEmbedding, QuantLinear
from kvbench.runtime.model.loading import _converted_gguf, cache_root, packaged_smollm2

log = logging.getLogger(__name__)

CORPORA = ("aclsum_train", "aclsum_val")
METHODS = ("fisher", "kmeans")
CACHE_VERSION = 1
_CHARS_PER_TOKEN_BOUND = 12  # a text prefix this many chars per token long holds enough tokens


@dataclass(frozen=True)
class CalibrationSettings:
    """What a calibration depends on (all of it goes into the cache key)."""

    bits: int = 3
    outlier_fraction: float = 0.01
    levels: str = "nuq"  # nuq | uniform (uniform: only key thresholds are calibrated)
    method: str = "fisher"  # fisher (sensitivity-weighted k-means) | kmeans
    key_ranges: str = "calibrated"  # calibrated | online
    corpus: str = "aclsum_train"
    num_sequences: int = 4
    seq_len: int = 1024
    block_size: int = 32  # tokens per block for the per-block outlier budget (the codec's block_size_hint)
    pre_rope: bool = True  # keys as the cache stores them
    max_samples: int = 1 << 22  # k-means samples per layer and kind (a uniform subsample beyond; default: all)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.bits not in (2, 3, 4):
            raise UserError(f"invalid kvquant bits={self.bits!r}: choices are 2, 3, 4")
        if self.levels not in ("nuq", "uniform"):
            raise UserError(f"invalid kvquant levels={self.levels!r}: choices are nuq, uniform")
        if self.method not in METHODS:
            raise UserError(f"invalid kvquant calibration={self.method!r}: choices are {', '.join(METHODS)}")
        if self.key_ranges not in ("calibrated", "online"):
            raise UserError(f"invalid kvquant key_ranges={self.key_ranges!r}: choices are calibrated, online")
        if self.corpus not in CORPORA:
            raise UserError(f"invalid kvquant calibration_corpus={self.corpus!r}: choices are {', '.join(CORPORA)}")
        for name in ("num_sequences", "seq_len", "block_size", "max_samples"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise UserError(f"invalid kvquant calibration {name}={v!r}: expected an integer >= 1")
        if self.seq_len <= self.block_size:
            raise UserError(f"calibration seq_len ({self.seq_len}) must exceed block_size ({self.block_size})")
        if not 0 <= self.outlier_fraction < 1:
            raise UserError(f"invalid kvquant outlier_fraction={self.outlier_fraction!r}: expected 0 <= f < 1")
        if self.levels == "uniform":  # no levels to fit: the k-means flavour does not matter (one cache entry)
            object.__setattr__(self, "method", "none")

    @property
    def needs_activations(self) -> bool:
        return self.levels == "nuq" or self.key_ranges == "calibrated"


@dataclass
class Calibration:
    """key_levels / value_levels [L, 2**bits] (None for uniform levels), key_ranges [L, H, 2, D] or None."""

    key_levels: torch.Tensor | None
    value_levels: torch.Tensor | None
    key_ranges: torch.Tensor | None
    info: dict


# ------------------------------------------------------------------------------------------ the forward
class _CaptureCache:
    """Stands in for the paged cache in `LlamaFamilyModel.forward` over one whole sequence: keeps every layer's
    K/V as given (before RoPE when store_pre_rope) and attends densely, so autograd sees the cached tensors.

    Each stored tensor is `k + zero` with a zero leaf that requires grad: the leaf's gradient is the total
    derivative of the loss with respect to that cache entry (through later layers too)."""

    def __init__(self, store_pre_rope: bool, grads: bool):
        self.store_pre_rope = store_pre_rope
        self.grads = grads
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self.zk: dict[int, torch.Tensor] = {}
        self.zv: dict[int, torch.Tensor] = {}

    def write(self, layer: int, plan, k: torch.Tensor, v: torch.Tensor) -> None:  # k, v: [1, H, T, D]
        if self.grads:
            self.zk[layer] = torch.zeros_like(k, requires_grad=True)
            self.zv[layer] = torch.zeros_like(v, requires_grad=True)
            k, v = k + self.zk[layer], v + self.zv[layer]
        self.k[layer], self.v[layer] = k, v

    def attend(self, layer: int, q: torch.Tensor, plan, scale: float, *, backend=None,
               return_key_scores: bool = False, rotate_keys=None, causal: bool = True):
        k, v = self.k[layer], self.v[layer]
        if rotate_keys is not None:
            k = rotate_keys(k, plan.query_positions[:, None, :].expand(k.shape[0], k.shape[1], -1))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                             enable_gqa=q.shape[1] != k.shape[1])
        return out, None


def forward_capture(model, ids: torch.Tensor, *, grads: bool = False, pre_rope: bool = True):
    """The runtime model's own forward (`LlamaFamilyModel.forward`) over ids [T], causal, with a capturing cache.

    Returns (logits [T, V], keys, values, key_grad2, value_grad2): per layer [H, T, D] tensors, keys as the
    KVQuant cache stores them (before RoPE when pre_rope). With grads=True, *_grad2 are the squared gradients of
    the mean next-token cross-entropy with respect to those keys and values; else None.
    """
    from types import SimpleNamespace

    T = ids.numel()
    tokens = ids.to(model.device).view(1, T)
    pos = torch.arange(T, device=model.device).view(1, T)
    L, H = model.config.num_layers, model.config.num_kv_heads
    plan = SimpleNamespace(query_positions=pos, lengths=torch.full((1, L, H), T, device=model.device))
    cache = _CaptureCache(pre_rope, grads)
    with torch.inference_mode(False), torch.set_grad_enabled(grads):
        logits = model.forward(tokens, cache, plan, logits_for="all")[0]  # [T, V]
        kg = vg = None
        if grads:
            loss = F.cross_entropy(logits[:-1].float(), tokens[0, 1:])
            zs = [cache.zk[l] for l in range(L)] + [cache.zv[l] for l in range(L)]
            g = torch.autograd.grad(loss, zs)
            kg = [t[0].float().square() for t in g[:L]]
            vg = [t[0].float().square() for t in g[L:]]
    keys = [cache.k[l].detach()[0] for l in range(L)]
    values = [cache.v[l].detach()[0] for l in range(L)]
    return logits.detach(), keys, values, kg, vg


# ------------------------------------------------------------------------------------------ fitting
def fit_from_activations(keys: list[list[torch.Tensor]], values: list[list[torch.Tensor]],
                         key_w: list[list[torch.Tensor]] | None, value_w: list[list[torch.Tensor]] | None,
                         settings: CalibrationSettings) -> Calibration:
    """keys[l][i] / values[l][i]: layer l of calibration sequence i, [H, T, D] (the first block already dropped
    or not, as the caller wants); key_w / value_w: the matching sensitivity weights, or None (plain k-means)."""
    s = settings
    L = len(keys)
    bs = s.block_size
    key_ranges = key_levels = value_levels = None
    if s.key_ranges == "calibrated":
        key_ranges = torch.stack([fit_channel_ranges(torch.cat(keys[l], dim=1), s.outlier_fraction)
                                  for l in range(L)])  # [L, H, 2, D]
    if s.levels == "nuq":
        kl, vl = [], []
        for l in range(L):
            kx, kw, vx, vw = [], [], [], []
            for i, (k, v) in enumerate(zip(keys[l], values[l])):
                H, T, D = k.shape
                nblk = T // bs
                kb = k[:, : nblk * bs].reshape(H, nblk, bs, D)  # [H, n, bs, D]
                vb = v[:, : nblk * bs].reshape(H * nblk, bs, D)
                for h in range(H):
                    ranges = None
                    if key_ranges is not None:
                        r = key_ranges[l, h]  # [2, D]
                        ranges = (r[0:1], r[1:2])
                    xn, mask = dense_normalized(kb[h], 1, s.outlier_fraction, ranges)
                    kx.append(xn[mask])
                    if key_w is not None:
                        kw.append(key_w[l][i][h, : nblk * bs].reshape(nblk, bs, D)[mask])
                xn, mask = dense_normalized(vb, 2, s.outlier_fraction)
                vx.append(xn[mask])
                if value_w is not None:
                    vw.append(value_w[l][i][:, : nblk * bs].reshape(H * nblk, bs, D)[mask])
            kl.append(fit_nuq_levels(torch.cat(kx), s.bits, _normalized(kw), max_samples=s.max_samples,
                                     seed=s.seed + l))
            vl.append(fit_nuq_levels(torch.cat(vx), s.bits, _normalized(vw), max_samples=s.max_samples,
                                     seed=s.seed + 1000 + l))
        key_levels, value_levels = torch.stack(kl), torch.stack(vl)
    return Calibration(key_levels, value_levels, key_ranges, {})


def _normalized(weights: list[torch.Tensor]) -> torch.Tensor | None:
    """Concatenated weights scaled to mean 1 (squared gradients are ~1e-10: keep k-means sums well inside fp32)."""
    if not weights:
        return None
    w = torch.cat(weights)
    m = w.mean()
    return w / m if float(m) > 0 else torch.ones_like(w)


def _log_line(message: str) -> None:
    """Progress of a calibration: one line on stderr per step (it runs once per model and settings, minutes)."""
    print(f"kvbench: {message}", file=sys.stderr, flush=True)


def calibrate_on_tokens(model, sequences: Sequence[Sequence[int]], settings: CalibrationSettings,
                        progress: Callable[[str], None] | None = None) -> Calibration:
    """Run the calibration forward over token sequences and fit levels / thresholds (no disk cache). `progress`
    receives one line per step (default: stderr)."""
    s = settings
    L = model.config.num_layers
    fisher = s.method == "fisher" and s.levels == "nuq"
    keys: list[list[torch.Tensor]] = [[] for _ in range(L)]
    values: list[list[torch.Tensor]] = [[] for _ in range(L)]
    kw: list[list[torch.Tensor]] | None = [[] for _ in range(L)] if fisher else None
    vw: list[list[torch.Tensor]] | None = [[] for _ in range(L)] if fisher else None
    t0 = time.perf_counter()
    n_tokens = 0
    say = progress or _log_line
    linears = [lin for lw in model.layers for lin in vars(lw).values() if isinstance(lin, Linear)] + [model.lm_head]
    for i, seq in enumerate(sequences):
        ids = torch.as_tensor(list(seq), dtype=torch.int64)
        if ids.numel() <= s.block_size:
            raise UserError(f"calibration sequence of {ids.numel()} tokens is too short (need > {s.block_size})")
        ts = time.perf_counter()
        with keep_dense_weights(linears if fisher else []):
            _, ks, vs, kg, vg = forward_capture(model, ids, grads=fisher, pre_rope=s.pre_rope)
        say(f"kvquant calibration: sequence {i + 1}/{len(sequences)} ({ids.numel()} tokens, "
            f"{'forward+backward' if fisher else 'forward'} {time.perf_counter() - ts:.1f} s)")
        for l in range(L):
            k = ks[l]
            # the first block stays in full precision in the cache: leave it out
            keys[l].append(k[:, s.block_size:].float().cpu())
            values[l].append(vs[l][:, s.block_size:].float().cpu())
            if fisher:
                kw[l].append(kg[l][:, s.block_size:].cpu())
                vw[l].append(vg[l][:, s.block_size:].cpu())
        n_tokens += ids.numel()
    t1 = time.perf_counter()
    if s.levels == "nuq":
        say(f"kvquant calibration: fitting {2 ** s.bits} levels per layer for keys and values ...")
    cal = fit_from_activations(keys, values, kw, vw, s)
    say(f"kvquant calibration: done in {time.perf_counter() - t0:.1f} s")
    cal.info = {"calibration_tokens": n_tokens, "calibration_sequences": len(sequences),
                "forward_s": round(t1 - t0, 2), "fit_s": round(time.perf_counter() - t1, 2)}
    return cal


# ------------------------------------------------------------------------------------------ corpus + cache
def calibration_sequences(tokenizer, settings: CalibrationSettings) -> list[list[int]]:
    """The first `seq_len` tokens of the first `num_sequences` documents of the calibration corpus that are at
    least that long."""
    split = settings.corpus.split("_", 1)[1]
    out = []
    for rec in load_aclsum(split):
        text = rec["document"][: settings.seq_len * _CHARS_PER_TOKEN_BOUND]
        ids = list(tokenizer(text)["input_ids"])
        if len(ids) >= settings.seq_len:
            out.append(ids[: settings.seq_len])
        if len(out) == settings.num_sequences:
            return out
    raise UserError(f"calibration corpus {settings.corpus} has only {len(out)} documents of "
                    f">= {settings.seq_len} tokens; lower calibration_sequences or calibration_tokens")


_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def model_fingerprint(model) -> str:
    """A short id of a LlamaFamilyModel: its config and exact, order-free checksums of every weight's bit patterns
    (integer sums, so neither the runtime's matrix layout nor the thread count changes it)."""
    h = hashlib.sha256(json.dumps(dataclasses.asdict(model.config), sort_keys=True).encode())
    h.update(str(model.dtype).encode())
    def weights(lin: Linear) -> list[torch.Tensor]:  # a quantized matrix by its blocks (no fp32 copy)
        parts = [p.data for p in lin.parts] if isinstance(lin, QuantLinear) else [lin.dense_weight()]
        return parts + ([lin.bias] if lin.bias is not None else [])

    embed = model.embed.matrix.data if isinstance(model.embed, QuantEmbedding) else model.embed
    tensors = [embed, model.final_norm, *weights(model.lm_head)]
    for lw in model.layers:
        for t in vars(lw).values():
            if isinstance(t, Linear):
                tensors += weights(t)
            elif isinstance(t, torch.Tensor):
                tensors.append(t)
    for t in tensors:
        bits = t.detach().contiguous().view(_INT_OF_SIZE[t.element_size()]).to(torch.int64)
        low = bits & 0xFFFF
        h.update(f"{bits.sum().item()} {(low * low).sum().item()} {t.numel()}".encode())
    return h.hexdigest()[:16]


def cache_path(model, settings: CalibrationSettings, cache_dir: str | Path | None = None) -> Path:
    root = Path(cache_dir) if cache_dir is not None else cache_root() / "kvquant"
    blob = json.dumps({"v": CACHE_VERSION, **dataclasses.asdict(settings)}, sort_keys=True)
    key = hashlib.sha256(blob.encode()).hexdigest()[:12]
    s = settings
    name = (f"{model.config.model_type}-{model_fingerprint(model)}-{s.levels}{s.bits}-{s.method}-{s.corpus}"
            f"-{s.num_sequences}x{s.seq_len}-{key}.pt")
    return root / name


def calibrate(model, tokenizer=None, settings: CalibrationSettings | None = None, *,
              cache_dir: str | Path | None = None, use_cache: bool = True) -> Calibration:
    """Levels and key thresholds for `model`, from the disk cache when there, else computed and saved."""
    settings = settings or CalibrationSettings()
    if not settings.needs_activations:
        return Calibration(None, None, None, {"cached": False})
    path = cache_path(model, settings, cache_dir)
    if use_cache and path.is_file():
        cached = _read_cached(path)
        if cached is not None:
            _log_line(f"kvquant calibration: reusing the cached one in {path}")
            return cached
    tok = resolve_tokenizer(model, tokenizer)
    seqs = calibration_sequences(tok, settings)
    _log_line(f"kvquant calibration ({settings.method}, {len(seqs)} x {settings.seq_len} tokens of "
              f"{settings.corpus}), once per model and settings; later runs reuse {path}")
    cal = calibrate_on_tokens(model, seqs, settings)
    cal.info.update(settings=dataclasses.asdict(settings), model_fingerprint=model_fingerprint(model))
    if use_cache:
        _write_cached(path, cal)
    cal.info.update(cached=False, cache_file=str(path))
    return cal


_CACHED_TENSORS = ("key_levels", "value_levels", "key_ranges")


def _read_cached(path: Path) -> Calibration | None:
    """The calibration stored in `path`, or None (with a warning naming the file) when it cannot be read whole: a
    truncated or corrupt file (a crash or a full disk while another version wrote it) is computed again."""
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
        info = json.loads(data["info"])
        tensors = {name: data.get(name) for name in _CACHED_TENSORS}
        if not isinstance(info, dict) or not any(isinstance(t, torch.Tensor) for t in tensors.values()):
            raise ValueError("no calibration tensors in it")
        if not all(t is None or bool(torch.isfinite(t).all()) for t in tensors.values()):
            raise ValueError("non-finite values in it")
    except Exception as exc:  # torch.load raises RuntimeError, EOFError, pickle errors... on a damaged file
        warn(f"the cached kvquant calibration {path} is unreadable ({type(exc).__name__}: "
             f"{first_line(exc, fallback='damaged')}); computing it again")
        return None
    return Calibration(tensors["key_levels"], tensors["value_levels"], tensors["key_ranges"],
                       {**info, "cached": True, "cache_file": str(path)})


def _write_cached(path: Path, cal: Calibration) -> None:
    """Store `cal` in `path` atomically: written to a temp file of this writer's own (calibrators running at once
    never share one), then renamed over `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data: dict[str, Any] = {"info": json.dumps(cal.info)}
    for name in _CACHED_TENSORS:
        if getattr(cal, name) is not None:
            data[name] = getattr(cal, name).float().cpu().contiguous()
    with atomic_write.replaced(path, mode=0o600) as tmp:  # 0600: this user's cache, as it always was
        torch.save(data, tmp)


def resolve_tokenizer(model, tokenizer=None):
    """The tokenizer for the calibration text: the one given, `model.tokenizer` when the loader attached one, or
    the packaged SmolLM2's when the model has its vocabulary (the embedded default)."""
    if tokenizer is not None:
        return tokenizer
    tok = getattr(model, "tokenizer", None)
    if tok is not None:
        return tok
    if model.config.vocab_size == 49152 and model.config.num_layers == 30 and model.config.hidden_size == 576:
        from transformers import AutoTokenizer

        folder, gguf = packaged_smollm2()
        return AutoTokenizer.from_pretrained(str(_converted_gguf(folder, gguf, None)))
    raise UserError("kvquant calibration needs the model's tokenizer: pass tokenizer= to build_codec "
                    "(or attach it as model.tokenizer when loading)")

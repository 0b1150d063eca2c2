"""The engine: chunked prefill, batched decoding, sampling and scoring over the paged cache.

    engine = Engine(model, method, block_size=16, prefill_chunk_size=512)
    logprobs = engine.score(token_ids)                      # [T-1] streaming, method applied
    gens = engine.generate([ids_a, ids_b], max_new_tokens=64, stop_token_ids=[eos])
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch

from kvbench.runtime.attention import paged_attention_torch
from kvbench.runtime.kv_cache import PagedKVCache
from kvbench.runtime.model import LlamaFamilyModel

DEFAULT_KV_MEMORY_BYTES = 4 * 1024**3  # virtual until written: pages are touched only as blocks fill


@dataclass
class Generation:
    """One sequence's output and timings."""

    token_ids: list[int]
    finish_reason: str  # "stop" | "length"
    ttft_s: float
    prefill_tokens: int
    prefill_s: float
    decode_tokens: int
    decode_s: float


class Engine:
    """Runs a LlamaFamilyModel over a PagedKVCache with a compression method hooked in."""

    def __init__(
        self,
        model: LlamaFamilyModel,
        method=None,
        *,
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_memory_bytes: int | None = None,
        prefill_chunk_size: int = 512,
        attention_backend: str = "auto",
        max_seqs: int = 64,
        codec=None,
    ):
        if method is None:
            from methods import build_method

            method = build_method("full")
        if prefill_chunk_size < 1:
            raise ValueError(f"prefill_chunk_size must be >= 1, got {prefill_chunk_size}")
        self.model, self.method = model, method
        cfg = model.config
        self.prefill_chunk_size = prefill_chunk_size
        elem = torch.empty((), dtype=model.dtype).element_size()
        block_bytes = 2 * block_size * cfg.head_dim * elem
        if num_blocks is None:
            num_blocks = max(2, (kv_memory_bytes or DEFAULT_KV_MEMORY_BYTES) // block_bytes)
        if codec is None:
            codec = method.make_codec(model)
        cache_kwargs = dict(
            num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
            block_size=block_size, num_blocks=int(num_blocks), dtype=model.dtype, device=model.device,
            max_seqs=max_seqs, store_pre_rope=method.store_pre_rope or bool(getattr(codec, "pre_rope_keys", False)),
        )
        if codec is None or getattr(codec, "name", "full") == "full":
            self.cache = PagedKVCache(**cache_kwargs)
        else:
            from kvbench.runtime.quantized_cache import QuantizedPagedKVCache

            self.cache = QuantizedPagedKVCache(codec=codec, **cache_kwargs)
        self.codec = codec
        method.attach(self.cache, cfg)
        self.attention = self._pick_attention(attention_backend)
        # methods that never act after attention (full, pure codecs) are not called once per layer
        from methods.base import Method

        hook = method.after_attention
        acts = getattr(hook, "__func__", hook) is not Method.after_attention
        self._layer_hook = method if acts else None
        self._peak_full_bytes = 0

    # ------------------------------------------------------------------ backends
    def _pick_attention(self, backend: str):
        """auto: Triton on CUDA (post-RoPE keys, full-precision pool), the C decode kernel on CPU,
        the torch reference otherwise."""
        choices = ("auto", "torch", "cpu", "triton")
        if backend not in choices:
            raise ValueError(f"unknown attention_backend {backend!r}; choose one of: {', '.join(choices)}")
        on_cuda = self.model.device.type == "cuda"
        usable_triton = on_cuda and not self.cache.store_pre_rope and type(self.cache) is PagedKVCache
        if backend == "triton" and not usable_triton:
            raise ValueError("attention_backend=triton needs a CUDA device and post-RoPE keys")
        if backend == "cpu" and on_cuda:
            raise ValueError("attention_backend=cpu needs the model on the CPU")
        if backend == "triton" or (backend == "auto" and usable_triton):
            from kvbench.runtime.triton_attention import paged_attention_triton

            def triton_attention(q, k_pool, v_pool, tables, lengths, key_pos, qpos, scale, *,
                                 return_key_scores=False, rotate_keys=None, causal=True):
                res = paged_attention_triton(q, k_pool, v_pool, tables, lengths.to(torch.int32), key_pos,
                                             qpos.to(torch.int32), scale, return_key_scores=return_key_scores)
                return res if return_key_scores else (res, None)

            self.attention_backend = "triton"
            return triton_attention
        if backend == "cpu" or (backend == "auto" and not on_cuda):
            from kvbench.runtime.cpu_kernels import load_kernel, paged_attention_cpu

            if load_kernel() is not None:
                self.attention_backend = "cpu"
                return paged_attention_cpu
            if backend == "cpu":
                from kvbench.runtime.cpu_kernels import kernel_error

                raise ValueError(f"attention_backend=cpu: the C kernel could not be built ({kernel_error()})")
        self.attention_backend = "torch"
        return paged_attention_torch

    # ------------------------------------------------------------------ one step
    @torch.no_grad()
    def _step(self, slots: list[int], tokens: torch.Tensor, positions: torch.Tensor, *, phase: str,
              last_chunk: bool, logits_for: str) -> torch.Tensor | None:
        plan = self.cache.prepare_append(slots, positions)
        logits = self.model.forward(
            tokens, self.cache, plan, attention=self.attention, hook=self._layer_hook, phase=phase,
            last_chunk=last_chunk, logits_for=logits_for, rope_mode=self.method.rope_mode,
        )
        self._track_full_bytes()
        return logits

    def _track_full_bytes(self) -> None:
        c = self.cache
        bs = c.block_size
        blocks = sum(-(-c.tokens_seen[s] // bs) for s in c.live) * c.num_layers * c.num_kv_heads
        full = blocks * 2 * bs * c.head_dim * torch.empty((), dtype=c.dtype).element_size()  # model dtype
        self._peak_full_bytes = max(self._peak_full_bytes, full)

    def _prefill(self, slot: int, token_ids: Sequence[int], chunk_size: int, start_pos: int = 0, *,
                 stream: bool = False,
                 logits_for: str = "last", progress: Callable[[int], None] | None = None):
        """Feed token_ids into sequence `slot` chunk by chunk; yields each chunk's logits."""
        ids = torch.as_tensor(list(token_ids), dtype=torch.int64, device=self.model.device)
        n = ids.numel()
        for a in range(0, n, chunk_size):
            b = min(n, a + chunk_size)
            pos = torch.arange(start_pos + a, start_pos + b, device=ids.device).unsqueeze(0)
            out = self._step([slot], ids[a:b].unsqueeze(0), pos, phase="prefill", last_chunk=stream or b == n,
                             logits_for=logits_for)
            if progress is not None:
                progress(b - a)
            yield a, b, out

    # ------------------------------------------------------------------ public API
    @torch.no_grad()
    def score(self, token_ids: Sequence[int], chunk_size: int | None = None,
              progress: Callable[[int], None] | None = None) -> torch.Tensor:
        """log p(token[t+1] | tokens[<=t]) for t = 0..T-2, float32 [T-1].

        The tokens stream through the cache chunk by chunk; every chunk ends a prompt as far as the
        method is concerned (it compresses after each, whatever its prefill_mode), so later chunks are
        scored against the compressed cache.
        """
        chunk = chunk_size or self.prefill_chunk_size
        ids = torch.as_tensor(list(token_ids), dtype=torch.int64)
        if ids.numel() < 2:
            raise ValueError("score needs at least 2 tokens")
        slot = self.cache.add_sequence()
        out = torch.empty(ids.numel() - 1, dtype=torch.float32)
        try:
            for a, b, logits in self._prefill(slot, ids.tolist(), chunk, logits_for="all", progress=progress,
                                                  stream=True):
                lp = torch.log_softmax(logits[0].float(), dim=-1)  # [b-a, V]
                tgt_end = min(b, ids.numel() - 1)
                if tgt_end > a:
                    tgt = ids[a + 1: tgt_end + 1].to(lp.device)
                    out[a:tgt_end] = lp[: tgt_end - a].gather(-1, tgt.unsqueeze(-1)).squeeze(-1).cpu()
        finally:
            self._end_sequence(slot)
        return out

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], *, max_new_tokens: int, stop_token_ids: Iterable[int] = (),
                 temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
                 chunk_size: int | None = None,
                 should_stop: Callable[[int, list[int]], bool] | None = None) -> list[Generation]:
        """Generate for a batch of prompts of any lengths; each prompt is prefilled (chunked), then all
        decode together one token per step. Greedy when temperature == 0.

        should_stop(i, token_ids) -> True ends prompt i after its latest token (e.g. a stop string)."""
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("empty prompt")
        stops = set(int(t) for t in stop_token_ids)
        gen = torch.Generator(device="cpu")
        if seed is not None:
            gen.manual_seed(seed)
        chunk = chunk_size or self.prefill_chunk_size
        dev = self.model.device
        slots, results, nxt = [], [], []
        try:
            for p in prompts:
                t0 = time.perf_counter()
                slot = self.cache.add_sequence()
                slots.append(slot)
                logits = None
                for _, _, logits in self._prefill(slot, p, chunk):
                    pass
                tok = self._sample(logits, temperature, top_p, gen)[0]
                _sync(dev)
                t1 = time.perf_counter()
                results.append(Generation([], "length", t1 - t0, len(p), t1 - t0, 0, 0.0))
                nxt.append(tok)
            active = list(range(len(prompts)))
            pos = [len(p) for p in prompts]
            for i in active:
                self._emit(results[i], nxt[i], stops, max_new_tokens, should_stop, i)
            active = [i for i in active if not self._done(results[i], stops, max_new_tokens)]
            for i in range(len(prompts)):
                if i not in active:
                    self._end_sequence(slots[i])
            while active:
                t0 = time.perf_counter()
                toks = torch.tensor([[nxt[i]] for i in active], dtype=torch.int64, device=dev)
                qpos = torch.tensor([[pos[i]] for i in active], dtype=torch.int64, device=dev)
                logits = self._step([slots[i] for i in active], toks, qpos, phase="decode", last_chunk=True,
                                    logits_for="last")
                new = self._sample(logits, temperature, top_p, gen)
                _sync(dev)
                dt = time.perf_counter() - t0
                still = []
                for j, i in enumerate(active):
                    pos[i] += 1
                    nxt[i] = new[j]
                    results[i].decode_s += dt
                    results[i].decode_tokens += 1
                    self._emit(results[i], new[j], stops, max_new_tokens, should_stop, i)
                    if self._done(results[i], stops, max_new_tokens):
                        self._end_sequence(slots[i])
                    else:
                        still.append(i)
                active = still
        except BaseException:
            for s in slots:
                if s in self.cache.live:
                    self._end_sequence(s)
            raise
        return results

    def memory_stats(self) -> dict:
        """Figures measured from the pool: peak bytes held, what a full cache would have held."""
        c = self.cache
        return {
            "peak_kv_bytes": c.peak_kv_bytes(),
            "full_kv_bytes": self._peak_full_bytes,
            "kv_bytes_per_token": c.kv_bytes_per_token(),
            "kv_bytes_in_use": c.kv_bytes_in_use(),
            "block_size": c.block_size,
            "num_blocks": c.pool.num_blocks,
            "peak_blocks_in_use": c.pool.peak_in_use,
        }

    def reset_stats(self) -> None:
        self.cache.pool.reset_peak()
        self._peak_full_bytes = 0
        self._track_full_bytes()

    # ------------------------------------------------------------------ helpers
    def _end_sequence(self, slot: int) -> None:
        self.method.on_sequence_end(slot)
        self.cache.free_sequence(slot)

    @staticmethod
    def _emit(res: Generation, tok: int, stops: set[int], max_new: int, should_stop=None, index: int = 0) -> None:
        if len(res.token_ids) >= max_new or res.finish_reason == "stop":
            return
        res.token_ids.append(int(tok))
        if tok in stops or (should_stop is not None and should_stop(index, res.token_ids)):
            res.finish_reason = "stop"

    @staticmethod
    def _done(res: Generation, stops: set[int], max_new: int) -> bool:
        return res.finish_reason == "stop" or len(res.token_ids) >= max_new

    @staticmethod
    def _sample(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator) -> list[int]:
        """logits [S, V] -> one token id per row."""
        if temperature <= 0:
            return logits.argmax(dim=-1).tolist()
        probs = torch.softmax(logits.float().cpu() / temperature, dim=-1)
        if top_p < 1.0:
            sp, si = probs.sort(dim=-1, descending=True)
            keep = sp.cumsum(-1) - sp < top_p
            sp = sp * keep
            probs = torch.zeros_like(probs).scatter(-1, si, sp)
        return torch.multinomial(probs, 1, generator=gen).squeeze(-1).tolist()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)

"""The engine: the step (one ragged forward over the paged cache), sampling, and the serving loop around them.

    engine = Engine(model, method, block_size=16, prefill_chunk_size=512)
    gens = engine.generate([ids_a, ids_b], max_new_tokens=64, stop_token_ids=[eos])   # via the scheduler
    outcome = engine.serve([Request(ids, 128, arrival_s=0.5), ...])                   # a serving trace

`method` is any object with the hook protocol (kvbench.runtime.hooks.NoCompression declares every member, with its
default; an object that does not subclass it gets those defaults through hooks.declared); the runtime never imports
the methods. `codec` is a storage codec or None (full precision); kvbench.runtime.cache.caches builds the matching
cache.
`attention_backend` picks the kernels (kvbench.runtime.backends: auto | torch | cpu | triton).
Log-likelihoods of given tokens (perplexity, lm-eval) are kvbench.runtime.serving.scoring.Scorer's, over this engine.

Serving is schedule -> run -> postprocess (nano-vllm's and vLLM v1's loop): the scheduler says what each step runs
(a StepBatch, kvbench.runtime.serving.batch), the model runner runs it as one ragged forward
(kvbench.runtime.serving.model_runner), the engine samples, and the scheduler advances the requests. Two optional
parts, constructor arguments (off by default): `speculator` (a kvbench.runtime.serving.speculative.SpeculativeDecoder:
decode steps become speculative rounds) and `preemption` swap | auto with `swap_bytes` (kvbench.runtime.cache.swap:
preemption may move blocks to host memory, in a swap space of swap_bytes, the pool's size by default).
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch

from kvbench.runtime.backends.selection import select_backend
from kvbench.runtime.cache.block_pool import OutOfBlocksError
from kvbench.runtime.cache.caches import build_cache
from kvbench.runtime.cache.kv_geometry import block_bytes, pool_bytes
from kvbench.runtime.cache.kv_meter import KVMeter
from kvbench.runtime.cache.prefix_cache import PrefixCache
from kvbench.runtime.cache.swap import SwapSpace
from kvbench.runtime.hooks import declared
from kvbench.runtime.model.forward import LlamaFamilyModel
from kvbench.runtime.model.tensor_parallel import rank_agreed
from kvbench.runtime.serving.batch import Segment, StepBatch
from kvbench.runtime.serving.decode_graphs import DecodeGraphs
from kvbench.runtime.serving.model_runner import ModelRunner
from kvbench.runtime.serving.requests import Outcome, Request, Scheduled
from kvbench.runtime.serving.sampling import sample
from kvbench.runtime.serving.scheduler import Scheduler
from kvbench.runtime.serving.scoring import Scorer
from kvbench.run.spec import PREEMPTION_MODES, SCHEDULES

DEFAULT_KV_MEMORY_BYTES = 4 * 1024**3  # virtual until written: pages are touched only as blocks fill
log = logging.getLogger(__name__)


@dataclass
class Generation:
    """One sequence's output and timings."""

    token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "failed"
    ttft_s: float  # from the generate() call to the first token
    prefill_tokens: int
    prefill_s: float
    decode_tokens: int
    decode_s: float
    preemptions: int = 0
    error: str | None = None
    kv_kept_fraction: float | None = None  # the method's prompt_kept_fraction at the first generated token


@dataclass
class ContextPrefill:
    """A context prefilled (and compressed by the method at its last chunk) for requests to fork
    (`Engine.prefill_context`): the live sequence holding it, whether it came from the kept compressed contexts
    (a hit: nothing computed), the tokens it holds and the seconds it took."""

    slot: int
    hit: bool
    tokens: int
    prefill_s: float


def kv_memory_bytes_for(model: LlamaFamilyModel, block_size: int, num_blocks: int | None,
                        kv_memory_bytes: int | None) -> int:
    """The pool's KV bytes for these settings: kv_memory_bytes if given, else what num_blocks - 1 full-precision
    blocks of the model take, else DEFAULT_KV_MEMORY_BYTES."""
    if kv_memory_bytes is None:
        kv_memory_bytes = (pool_bytes(num_blocks, block_bytes(block_size, model.config.head_dim, model.dtype))
                           if num_blocks is not None else DEFAULT_KV_MEMORY_BYTES)
    return int(kv_memory_bytes)


class Engine:
    """Runs a LlamaFamilyModel over a PagedKVCache with a compression method hooked in."""

    def __init__(
        self,
        model: LlamaFamilyModel,
        method=None,
        *,
        codec=None,
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_memory_bytes: int | None = None,
        prefill_chunk_size: int = 512,
        attention_backend: str = "auto",
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        admission_watermark: float = 0.01,
        schedule: str = "mixed",
        prefix_caching: bool | str = "auto",
        cuda_graphs: bool | None = None,
        speculator=None,
        preemption: str = "recompute",
        swap_bytes: int | None = None,
    ):
        if prefill_chunk_size < 1:
            raise ValueError(f"prefill_chunk_size must be >= 1, got {prefill_chunk_size}")
        method = declared(method)
        self.model, self.method, self.codec = model, method, codec
        cfg = model.config
        self.prefill_chunk_size = prefill_chunk_size
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.admission_watermark = admission_watermark
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r}; choose one of: {', '.join(SCHEDULES)}")
        if preemption not in PREEMPTION_MODES:
            raise ValueError(f"unknown preemption {preemption!r}; choose one of: {', '.join(PREEMPTION_MODES)}")
        self.schedule = schedule
        method.check_model(cfg)  # before the cache is built for it (an MLA latent cache, a pruned-key layout)
        self.kv_memory_bytes = kv_memory_bytes_for(model, block_size, num_blocks, kv_memory_bytes)
        self.cache = build_cache(
            codec=codec, kv_memory_bytes=self.kv_memory_bytes, num_layers=cfg.num_layers,
            num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, block_size=block_size, dtype=model.dtype,
            device=model.device, store_pre_rope=bool(method.store_pre_rope),
            pruned_key_channels=int(method.pruned_key_channels(cfg.head_dim)),
            value_dim=cfg.mla.kv_lora_rank if cfg.mla is not None else None,  # MLA: the latent cache
        )
        self.cache.defer_frees = True  # evicted block ids travel with each step's sampled tokens (_sample_step)
        windows = cfg.layer_windows
        if any(w is not None for w in windows):  # sliding layers: a ring of their window (PagedKVCache.slide_window)
            self.cache.layer_windows = windows
            if speculator is not None:
                raise ValueError("speculative decoding rolls back tokens a sliding layer's ring has already freed: "
                                 "not supported for a model with sliding-window layers")
            if prefix_caching is True:
                raise ValueError("prefix_caching=true: a sliding layer's ring frees a shared prefix's first blocks; "
                                 "use false or auto for a model with sliding-window layers")
            prefix_caching = False
        method.attach(self.cache, cfg)
        if method.page_retrieval is not None:  # a retrieval method: decode reads its blocks only
            self.cache.enable_page_retrieval(method.page_retrieval)
        self.backend = select_backend(attention_backend, model.device, self.cache)
        self.attention_backend = self.backend.name
        self.meter = KVMeter(self.cache)  # the run's KV figures (memory_stats)
        self.runner = ModelRunner(model, self.cache, self.backend, method, self.meter)  # one forward step
        self.prefix_cache = PrefixCache(self.cache) if self._prefix_caching_on(prefix_caching) else None
        # compressed contexts kept for prefill_context (prefix caching on): exact token list -> a kept fork
        self._contexts: OrderedDict[tuple, int] = OrderedDict()
        self.max_kept_contexts = 1  # each holds a whole compressed context's blocks
        self.context_lookups = self.context_hits = 0
        # a kvbench.runtime.serving.speculative.SpeculativeDecoder: decode steps become rounds
        self.speculator = speculator
        self.preemption = preemption  # recompute | swap | auto (kvbench.runtime.cache.swap.should_swap)
        # where swapped-out blocks wait (host memory): none when preemption only recomputes
        self.swap = (SwapSpace(self.cache, swap_bytes if swap_bytes is not None else self.cache.pool_bytes())
                     if preemption != "recompute" else None)
        on_cuda = model.device.type == "cuda"
        if cuda_graphs and not on_cuda:
            log.info("runtime.cuda_graphs ignored on %s: decode runs eagerly", model.device)
        elif cuda_graphs is not False and on_cuda:
            self.use_decode_graphs()
        method.bind_engine(self)  # methods that read the weights or run passes of their own (KVzip)

    @property
    def decode_graphs(self) -> DecodeGraphs | None:
        """The decode steps replayed from CUDA graphs (runtime.cuda_graphs; use_decode_graphs), or None: eager."""
        return self.runner.decode_graphs

    def use_decode_graphs(self, **options) -> DecodeGraphs | None:
        """Run decode steps from captured graphs (kvbench.runtime.serving.decode_graphs; options: capture, buckets);
        None (eager, with a log line) where this engine's method or cache cannot run captured."""
        graphs = DecodeGraphs(self.model, self.cache, self.backend, self.method, rope_mode=self.method.rope_mode,
                              max_batch=self.max_num_seqs, **options)
        why = graphs.supported()
        if why is not None:
            log.info("decode runs eagerly (no CUDA graphs): %s", why)
            graphs = None
        self.runner.decode_graphs = graphs
        return graphs

    def _prefix_caching_on(self, setting: bool | str) -> bool:
        """auto: on for methods that never act after attention (full precision, storage codecs), whose result does
        not depend on which forward computed a shared block; true: on for any method except those that accumulate
        attention over every prompt query (needs_key_scores: H2O-style), which a shared prefix would skip, and
        those that prune key channels (a pruned-key cache: ThinK)."""
        if setting not in ("auto", True, False):
            raise ValueError(f"prefix_caching must be auto, true or false, got {setting!r}")
        if setting == "auto":
            return not self.method.acts_after_attention
        if setting and getattr(self.cache, "pruned_channels", 0):
            raise ValueError(f"prefix_caching=true: method {self.method.name!r} prunes key channels "
                             "chosen by each whole prompt, which a shared prefix would take from another; use false "
                             "or auto")
        if setting and self.method.needs_key_scores:
            raise ValueError(f"prefix_caching=true: method {self.method.name!r} accumulates "
                             "attention over every prompt query, which a shared prefix skips; use false or auto")
        return bool(setting)

    def step(self, segments: list[Segment], logits_for: str = "last") -> list[torch.Tensor]:
        """One ragged step: every segment's tokens in one forward (vLLM v1's flattened batch); the logits [V] of each
        segment's last token (logits_for="all": [n, V], every token's: speculative verification). See
        ModelRunner.run (kvbench.runtime.serving.model_runner): blocks are allocated group by group, and the caller
        makes sure they fit (an OutOfBlocksError part-way leaves the earlier groups' sequences appended but not
        computed: the scheduler preempts them all)."""
        return self.runner.run(segments, logits_for)

    def forward_chunk(self, slot: int, token_ids: Sequence[int], start_pos: int, *, last_chunk: bool = True,
                      logits_for: str = "last", compress: bool = True, scratch: bool = False) -> torch.Tensor | None:
        """Append one chunk of tokens (positions start_pos..) to sequence `slot`: logits [1, V] ("last"),
        [1, Q, V] ("all") or None. `last_chunk` tells the method the prompt ends here (it may compress).
        compress=False: the method keeps these tokens uncompressed (its `keep_uncompressed` hook: a question
        appended after its context was compressed). scratch=True: a method's own pass over the sequence (KVzip's
        reconstruction), whose tokens the method drops afterwards: not counted as the sequence's tokens
        (cache.tokens_seen: the prompt's length, full_kv_bytes), and no after_prefill_chunk call."""
        if not compress:
            self.method.keep_uncompressed(slot, len(token_ids))
        ids = torch.as_tensor(list(token_ids), dtype=torch.int64, device=self.model.device).unsqueeze(0)
        pos = torch.arange(start_pos, start_pos + ids.shape[1], device=ids.device).unsqueeze(0)
        logits = self.runner.forward([slot], ids, pos, phase="prefill", last_chunk=last_chunk, logits_for=logits_for,
                                     scratch=scratch, max_position=start_pos + ids.shape[1] - 1)
        if not scratch:  # the chunk's token ids, after its step (KVzip's reconstruction pass)
            self.method.after_prefill_chunk(slot, list(token_ids), start_pos, last_chunk)
            if not self.cache.has_pending_frees():  # what the hook evicted (KVzip's): held_kv_bytes sees it
                self.meter.track(after_method_hook=True)
        return logits

    def decode_batch(self, slots: list[int], tokens: list[int], positions: list[int], temperature: float = 0.0,
                     top_p: float = 1.0, generator: torch.Generator | None = None) -> list[int]:
        """One decode step: token i at position i appended to sequence slots[i]; returns the sampled next tokens."""
        dev = self.model.device
        toks = torch.tensor(tokens, dtype=torch.int64, device=dev).unsqueeze(1)  # [S, 1]
        qpos = torch.tensor(positions, dtype=torch.int64, device=dev).unsqueeze(1)  # [S, 1]
        logits = self.runner.forward(slots, toks, qpos, phase="decode", last_chunk=True, logits_for="last",
                                     max_position=max(positions))
        return self._sample_step(logits, temperature, top_p, generator or torch.Generator(device="cpu"))

    def new_sequence(self) -> int:
        """A new, empty sequence slot."""
        return self.cache.add_sequence()

    def fork_sequence(self, slot: int, *, scratch: bool = False) -> int:
        """A new sequence sharing every block of `slot` (copy-on-write on its first write); the method copies its
        state for it (`on_fork`), so both go on exactly as the original would. scratch=True: a method's own pass
        runs on the child (KVzip's reconstruction on a model with sliding layers), which it ends afterwards: its
        blocks count in the pool (peak_kv_bytes) but it is no sequence of the workload (not in full_kv_bytes)."""
        child = self.cache.fork(slot)
        if scratch:
            self.cache.scratch_slots.add(child)
        self.method.on_fork(slot, child)
        return child

    @torch.no_grad()
    def prefill_context(self, token_ids: Sequence[int], *, chunk_size: int | None = None) -> ContextPrefill:
        """Prefill a context in chunks on a new sequence, the method compressing it at its last chunk, for
        requests to fork (`Request.fork_of`, `fork_tokens=len(token_ids)`); the caller ends the returned slot.

        With the prefix cache on (`prefix_caching`), the compressed context is also kept (a fork of it, keyed by
        its exact token list; at most `max_kept_contexts`, the least recently used dropped first), and a later call
        with the same tokens returns a fork of that copy: a hit, no token computed and no compression run, the
        blocks shared in the pool. A kept copy holds its blocks until it is dropped (`release_contexts`)."""
        ids = [int(t) for t in token_ids]
        if not ids:
            raise ValueError("empty context")
        key = tuple(ids)
        if self.prefix_cache is not None:
            self.context_lookups += 1
            kept = self._contexts.get(key)
            if kept is not None:
                self._contexts.move_to_end(key)
                self.context_hits += 1
                child = self.fork_sequence(kept)
                self.meter.track()
                return ContextPrefill(child, True, len(ids), 0.0)
        if self.prefix_cache is not None:  # room first: the least recently used kept copy goes before this prefill
            while self._contexts and len(self._contexts) >= self.max_kept_contexts:
                self.end_sequence(self._contexts.popitem(last=False)[1])
        t0 = time.perf_counter()
        slot = self.new_sequence()
        chunk = chunk_size or self.prefill_chunk_size
        try:
            for a in range(0, len(ids), chunk):
                b = min(len(ids), a + chunk)
                self.forward_chunk(slot, ids[a:b], a, last_chunk=b == len(ids))
            self.flush_pending_frees()
        except BaseException:
            self.end_sequence(slot)
            raise
        self.meter.track()
        self._synchronize()
        dt = time.perf_counter() - t0
        if self.prefix_cache is not None and self.max_kept_contexts > 0:
            self._contexts[key] = self.fork_sequence(slot)
        return ContextPrefill(slot, False, len(ids), dt)

    def release_contexts(self) -> None:
        """Drop the compressed contexts prefill_context kept: their blocks go back to the pool."""
        while self._contexts:
            self.end_sequence(self._contexts.popitem()[1])

    def end_sequence(self, slot: int) -> None:
        """Forget a sequence: the method drops its state, its blocks go back to the pool at once."""
        self.meter.saw_sequence(slot)
        if self.speculator is not None:
            self.speculator.forget(slot)
        self.method.on_sequence_end(slot)
        self.cache.free_sequence(slot)

    # ------------------------------------------------------------------ public API
    def score(self, token_ids: Sequence[int], chunk_size: int | None = None,
              progress: Callable[[int], None] | None = None) -> torch.Tensor:
        """`Scorer(self).score` (kvbench.runtime.serving.scoring): log p(token[t+1] | tokens[<=t]), float64 [T-1]; the
        perplexity task's one call into an engine (the harness tests give it a fake engine with this method)."""
        return Scorer(self).score(token_ids, chunk_size, progress)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], *, max_new_tokens: int, stop_token_ids: Iterable[int] = (),
                 temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
                 chunk_size: int | None = None,
                 should_stop: Callable[[int, list[int]], bool] | None = None,
                 uncompressed_tails: Sequence[int] | None = None,
                 question_tokens: Sequence[int] | None = None) -> list[Generation]:
        """Generate for a batch of prompts of any lengths, through the continuous-batching scheduler (all
        submitted at once; it decides how many run together). Greedy when temperature == 0.

        should_stop(i, token_ids) -> True ends prompt i after its latest token (e.g. a stop string). A prompt
        that can never fit in the pool comes back with finish_reason "failed" and its error; the others finish.
        uncompressed_tails[i] > 0: prompt i's last tokens (a question) go in uncompressed after the method
        compressed the rest (kvpress's query-agnostic protocol; Request.uncompressed_tail). question_tokens[i] > 0:
        the last tokens of prompt i's compressed part are its question, compressed with it (Request.question_tokens)."""
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("empty prompt")
        if not prompts:
            return []
        tails = list(uncompressed_tails) if uncompressed_tails is not None else [0] * len(prompts)
        if len(tails) != len(prompts):
            raise ValueError(f"{len(tails)} uncompressed_tails for {len(prompts)} prompts")
        questions = list(question_tokens) if question_tokens is not None else [0] * len(prompts)
        if len(questions) != len(prompts):
            raise ValueError(f"{len(questions)} question_tokens for {len(prompts)} prompts")
        reqs = [Request([int(t) for t in p], max_new_tokens, uncompressed_tail=int(n), question_tokens=int(qn))
                for p, n, qn in zip(prompts, tails, questions)]
        kept: dict[int, float | None] = {}

        def on_token(r: Request) -> None:  # the prompt is compressed before its first token
            if len(r.output) == 1 and r.slot is not None:
                kept[r.index] = self.method.prompt_kept_fraction(r.slot)

        self.serve(reqs, stop_token_ids=stop_token_ids, temperature=temperature, top_p=top_p, seed=seed,
                   chunk_size=chunk_size, should_stop=should_stop, on_token=on_token)
        return [Generation(r.output, r.finish_reason, r.first_token_s if r.first_token_s is not None else 0.0,
                           r.prefill_tokens, r.prefill_s, r.decode_tokens, r.decode_s, r.preemptions, r.error,
                           kept.get(r.index)) for r in reqs]

    @torch.no_grad()
    def serve(self, requests: list[Request], *, stop_token_ids: Iterable[int] = (), temperature: float = 0.0,
              top_p: float = 1.0, seed: int | None = None, chunk_size: int | None = None,
              should_stop: Callable[[int, list[int]], bool] | None = None,
              on_token: Callable[[Request], None] | None = None,
              on_step: Callable[[int], None] | None = None) -> Outcome:
        """Run requests (with arrival times) through the scheduler; each request gets its output and timings.
        on_token(request) is called after every generated token, on_step(n) after every step with the tokens it
        ran, prompt tokens included (progress from the first prompt chunk). Each step is schedule -> run ->
        postprocess; a step that runs out of blocks part-way is undone by the scheduler (its sequences start over)."""
        sched = Scheduler(rank_agreed(self.cache, self.model.config), self.end_sequence, max_num_seqs=self.max_num_seqs,
                          max_num_batched_tokens=self.max_num_batched_tokens,
                          admission_watermark=self.admission_watermark,
                          chunk_size=chunk_size or self.prefill_chunk_size, schedule=self.schedule,
                          prefix_cache=self.prefix_cache, stop_token_ids=stop_token_ids, should_stop=should_stop,
                          on_token=on_token, lookahead=self.speculator.lookahead if self.speculator else 1,
                          swap=self.swap, preemption=self.preemption, on_swap_out=self._on_swap_out,
                          fork=self.fork_sequence)
        self._check_positions(requests)
        gen = torch.Generator(device="cpu")
        if seed is not None:
            gen.manual_seed(seed)
        sched.add(requests)
        try:
            while sched.has_unfinished():
                scheduled = sched.schedule()  # schedule
                if not scheduled:
                    continue
                batch = StepBatch.of(scheduled)
                t0 = sched.clock()
                try:  # run
                    if self.speculator is not None:
                        sampled = self._run_speculative(batch, temperature, top_p, gen)
                    else:
                        sampled = self._run(batch, temperature, top_p, gen)
                except OutOfBlocksError:
                    sched.undo_step(batch.scheduled)
                    continue
                sched.postprocess(batch.scheduled, sampled, sched.clock() - t0)  # postprocess
                if on_step is not None:
                    on_step(batch.num_tokens)
        except BaseException:
            sched.release_all()
            raise
        return sched.outcome()

    def _tell_method(self, scheduled: list[Scheduled]) -> None:
        """What the method hears of a step's requests right before it runs (the batch carries what the model needs):
        a chunk of an uncompressed tail stays uncompressed (keep_uncompressed); a prefill chunk of a prompt whose
        last tokens are its question says the question's extent (question_tokens: Finch's window)."""
        for sc in scheduled:
            if not sc.compress:
                self.method.keep_uncompressed(sc.req.slot, sc.n)
            if sc.req.question_tokens > 0 and sc.kind != "decode":
                self.method.question_tokens(sc.req.slot, sc.req.question_tokens)

    def _check_positions(self, requests: list[Request]) -> None:
        """A sequence longer than the model's positions is refused (ValueError: the run fails, named), never run at
        positions the model was not built for: its prompt and the tokens it may generate fed back (all but the
        last), against max_position_embeddings (the config's RoPE scaling is already in that limit; longrope: its
        original positions, model_checks.exact_positions)."""
        longest = max(requests, key=lambda r: len(r.prompt) + max(r.max_new_tokens - 1, 0), default=None)
        if longest is not None:
            self.check_positions(len(longest.prompt), max(longest.max_new_tokens - 1, 0))

    def check_positions(self, prompt_tokens: int, generated_tokens: int = 0) -> None:
        """ValueError when a sequence of prompt_tokens + generated_tokens (fed back) passes the model's positions. A
        method that re-indexes positions inside the cache (StreamingLLM's rope_mode) is exempt."""
        limit = getattr(self.model.config, "max_position_embeddings", None)
        if not limit or self.method.rope_mode != "original":
            return
        if prompt_tokens > limit:
            raise ValueError(f"a prompt of {prompt_tokens:,} tokens passes the model's {limit:,} positions "
                             f"(max_position_embeddings, RoPE scaling included): shorten the contexts (task.length, "
                             f"task.max_tokens, task.lengths) or use a model with more positions")
        if prompt_tokens + generated_tokens > limit:
            raise ValueError(f"a prompt of {prompt_tokens:,} tokens and {generated_tokens + 1:,} to generate pass "
                             f"the model's {limit:,} positions (max_position_embeddings, RoPE scaling included): "
                             f"shorten the contexts or the tokens generated, or use a model with more positions")

    def _run(self, batch: StepBatch, temperature: float, top_p: float, gen: torch.Generator) -> dict[int, int]:
        """One scheduled step as one ragged forward; {segment index: sampled token} for each segment in batch.emit
        (those that end their sequence's known tokens: a prompt's last chunk, a decode token). Waits for the
        device."""
        emit = batch.emit
        self._tell_method(batch.scheduled)
        logits = self.step(batch.segments)  # the public step (a caller may wrap it)
        toks = self._sample_step(_as_matrix([logits[i] for i in emit]), temperature, top_p, gen) if emit else []
        self.flush_pending_frees()  # a step that sampled nothing
        self._synchronize()
        return dict(zip(emit, toks))

    def _run_speculative(self, batch: StepBatch, temperature: float, top_p: float,
                         gen: torch.Generator) -> dict[int, list[int]]:
        """A scheduled step with speculation: the decode tokens become one speculative round (draft, verify in one
        ragged step, rollback), the prefill chunks one ragged step that the draft follows. {segment index: the
        tokens it emits}."""
        spec = self.speculator
        segments, emit, scheduled = batch.segments, batch.emit, batch.scheduled
        dec = [i for i, s in enumerate(segments) if s.phase == "decode"]
        pre = [i for i, s in enumerate(segments) if s.phase != "decode"]
        out: dict[int, list[int]] = {}
        if dec:
            items = [(segments[i].slot, scheduled[i].req.tokens,
                      scheduled[i].req.max_new_tokens - len(scheduled[i].req.output)) for i in dec]
            for i, toks in zip(dec, spec.decode(self, items, temperature, top_p, gen)):
                out[i] = toks
        if pre:
            self._tell_method([scheduled[i] for i in pre])
            logits = self.step([segments[i] for i in pre])
            spec.follow_prefill([(s.slot, s.token_ids, s.start_pos, s.last_chunk) for s in (segments[i] for i in pre)])
            emits = [i for i, j in enumerate(pre) if j in emit]
            if emits:
                toks = self._sample_step(torch.stack([logits[i] for i in emits]), temperature, top_p, gen)
                out.update({pre[i]: [t] for i, t in zip(emits, toks)})
            self.flush_pending_frees()  # as _run: blocks a method evicted on the device go back to the pool
        self._synchronize()
        return out

    def _on_swap_out(self, slot: int) -> None:
        """A sequence's blocks went to host memory: a draft sequence of it is dropped (rebuilt when it drafts)."""
        if self.speculator is not None:
            self.speculator.forget(slot)

    def _synchronize(self) -> None:
        """Wait for the device's queued work (CUDA), so step times are real."""
        dev = self.model.device
        if getattr(dev, "type", "cpu") == "cuda":
            torch.cuda.synchronize(dev)

    def memory_stats(self) -> dict:
        """The run's KV figures, measured from the pool (kvbench.runtime.cache.kv_meter.KVMeter.stats)."""
        return self.meter.stats()

    def sequence_kv(self, slot: int) -> dict:
        """What live sequence `slot` holds now (KVMeter.sequence)."""
        return self.meter.sequence(slot)

    # ------------------------------------------------------------------ helpers
    def _sample_step(self, logits: torch.Tensor, temperature: float, top_p: float,
                     gen: torch.Generator) -> list[int]:
        """`sample`, and the blocks the step's eviction left on the device back to the pool: greedy tokens and
        those block ids travel to the host in one transfer (the step's one host sync)."""
        pending = self.cache.take_pending_frees()
        if pending is None:
            return self.sample(logits, temperature, top_p, gen)
        if temperature <= 0:
            toks = logits.argmax(dim=-1)
            both = torch.cat([toks, pending.to(toks.dtype)]).tolist()
            out, freed = both[: toks.numel()], both[toks.numel():]
        else:
            out, freed = self.sample(logits, temperature, top_p, gen), pending.tolist()
        self.cache.free_pending(freed)
        self.meter.track()
        return out

    def flush_pending_frees(self) -> None:
        """Return to the pool the blocks that device-side eviction left pending (they normally travel with a step's
        sampled tokens, `_sample_step`); for callers that run `step` and sample on their own (speculative rounds)."""
        if self.cache.has_pending_frees():
            self.cache.free_pending_now()
            self.meter.track()

    @staticmethod
    def sample(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator) -> list[int]:
        """logits [S, V] -> one token id per row."""
        return sample(logits, temperature, top_p, gen)


def _as_matrix(rows: list[torch.Tensor]) -> torch.Tensor:
    """Rows [V] as one [n, V] tensor: the matrix they are views of when they are its rows 0..n-1 in order (a pure
    decode step's logits: no copy, which is costly once a step has flushed the caches), else a stacked copy."""
    base = rows[0]._base
    if (base is not None and base.dim() == 2 and base.shape[0] == len(rows)
            and all(r._base is base and r.storage_offset() == base.storage_offset() + i * base.stride(0)
                    and r.stride() == base.stride()[1:] and r.shape == base.shape[1:] for i, r in enumerate(rows))):
        return base
    return torch.stack(rows)

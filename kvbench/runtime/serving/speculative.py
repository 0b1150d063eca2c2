"""Speculative decoding over the paged pool: a draft proposes k tokens per sequence, the target verifies them in one
ragged step, and the KV slots of rejected tokens go back to the pool.

    draft = Engine(model, StreamingLLM(budget=256), ...)       # the target's model over a compressed cache ("self")
    engine = Engine(model, speculator=SpeculativeDecoder(draft, num_tokens=4, adaptive=True), ...)
    engine.serve(requests)                                     # decode steps are speculative rounds

A round, for every decoding sequence at once (P = its tokens so far; the target holds the first P-1):
  1. draft: the draft engine's cache catches up with the sequence (one-token steps; a whole prefill after a
     preemption) and proposes d1..dk by k one-token steps (greedy: argmax; sampling: drawn from its distribution q);
  2. verify: the target appends [last token, d1..dk] (positions P-1..P-1+k) in one ragged step and returns the
     logits of all k+1 of them;
  3. accept: greedy keeps the drafts while they equal the target's argmax, then the target's own token (the bonus);
     with temperature > 0, Leviathan et al.'s rejection sampling (accept d_i with min(1, p/q), else draw from
     norm(max(0, p - q)); all accepted: a bonus token from p), so the output is distributed as the target's;
  4. rollback: the target keeps positions < P + a (a drafts accepted; the bonus is fed next round), the draft the
     same (`PagedKVCache.truncate`: the rejected tokens' slots leave every table, emptied blocks are freed; the
     method's `on_rollback(slot)` hook, if any, drops what it kept about them). The checkpoint is the sequence's
     length P - 1 before the round: the slots appended after it are allocated, and only `P - 1 + a + 1` of them
     are committed.
`adaptive` shrinks a sequence's k by one when fewer than half its drafts were accepted in a round and grows it by
one (up to 2 x num_tokens) when all were. A target whose cache is a codec's verifies at most
`cache.append_horizon(slot)` tokens per round (its blocks are packed between steps), so verification reads exactly
what one-token steps read: the greedy output equals decoding without speculation, token for token.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from kvbench.runtime.cache.block_pool import OutOfBlocksError
from kvbench.runtime.serving.batch import Segment
from kvbench.runtime.serving.sampling import sampling_probs
from kvbench.run.spec import SPECULATIVE_MAX_TOKENS as MAX_NUM_TOKENS


@dataclass
class _DraftSequence:
    slot: int  # the sequence's slot in the draft engine's cache
    fed: int = 0  # tokens of the sequence in the draft cache (positions 0..fed-1)
    k: int = 4  # draft tokens to propose next round


@dataclass
class SpecStats:
    """What the rounds did, summed over every sequence and round."""

    rounds: int = 0  # (sequence, round) pairs that drafted at least one token
    draft_tokens: int = 0  # tokens proposed
    accepted_tokens: int = 0  # of them, accepted
    emitted_tokens: int = 0  # tokens produced by rounds (accepted + one per round from the target)
    plain_steps: int = 0  # (sequence, round) pairs that drafted nothing (k = 0: horizon, last token, draft pool full)
    draft_s: float = 0.0
    verify_s: float = 0.0
    draft_failures: int = 0  # draft steps refused for lack of blocks in the draft pool

    def as_metrics(self) -> dict:
        return {
            "acceptance_rate": self.accepted_tokens / self.draft_tokens if self.draft_tokens else None,
            "mean_accepted_tokens": self.accepted_tokens / self.rounds if self.rounds else None,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "speculative_rounds": self.rounds,
            "speculative_plain_steps": self.plain_steps,
            "draft_s": self.draft_s,
            "verify_s": self.verify_s,
            "draft_pool_failures": self.draft_failures,
        }


@dataclass
class DecodeItem:
    """One decoding sequence of a round: its target slot, all its tokens (prompt + output) and how many more it
    may emit (the round drafts at most remaining - 1: the target's own token comes on top)."""

    slot: int
    tokens: list[int]
    remaining: int = 1 << 30


def rejection_sample(p: torch.Tensor, q: torch.Tensor, drafts: list[int], gen: torch.Generator) -> list[int]:
    """Leviathan et al.'s acceptance (arXiv:2211.17192): p [k+1, V] the target's distributions at the k+1 verified
    positions, q [k, V] the draft's at the k drafted ones (both unnormalised rows are fine). Returns the accepted
    drafts followed by one token from the target's side (a resample from norm(max(0, p - q)) at the first rejection,
    or a bonus token from p[k] when all were accepted): distributed as sampling from p alone."""
    p = p / p.sum(-1, keepdim=True)
    q = q / q.sum(-1, keepdim=True)
    out: list[int] = []
    for i, d in enumerate(drafts):
        u = float(torch.rand((), generator=gen))
        if u * float(q[i, d]) < float(p[i, d]):  # u < p/q (q > 0: d was drawn from q)
            out.append(d)
            continue
        resid = (p[i] - q[i]).clamp(min=0)
        if float(resid.sum()) <= 0:  # p == q: cannot reject; kept for safety
            resid = p[i]
        out.append(int(torch.multinomial(resid, 1, generator=gen)))
        return out
    out.append(int(torch.multinomial(p[len(drafts)], 1, generator=gen)))
    return out


def greedy_accept(target_logits: torch.Tensor, drafts: list[int]) -> list[int]:
    """target_logits [k+1, V]: the accepted drafts (while each equals the target's argmax) and the target's token."""
    best = target_logits.argmax(-1).tolist()
    out: list[int] = []
    for i, d in enumerate(drafts):
        if best[i] != d:
            break
        out.append(d)
    out.append(best[len(out)])
    return out


def rollback(engine: Any, slot: int, num_tokens: int) -> int:
    """Cut sequence `slot` of `engine` back to positions < num_tokens (blocks freed); the method's optional
    `on_rollback(slot)` hook follows. Returns the blocks freed."""
    freed = engine.cache.truncate(slot, num_tokens)
    engine.method.on_rollback(slot)
    return freed


class SpeculativeDecoder:
    """Drafts with `draft` (an Engine: the target's model over a compressed cache, or a smaller model with the same
    tokenizer) and verifies with the target engine passed to `decode`; see the module docstring."""

    def __init__(self, draft: Any, num_tokens: int, *, adaptive: bool = False, max_tokens: Optional[int] = None):
        if not 1 <= num_tokens <= MAX_NUM_TOKENS:
            raise ValueError(f"num_tokens must be 1..{MAX_NUM_TOKENS}, got {num_tokens}")
        self.draft = draft
        self.num_tokens = num_tokens
        self.adaptive = adaptive
        self.max_tokens = max_tokens or (min(MAX_NUM_TOKENS, 2 * num_tokens) if adaptive else num_tokens)
        self.stats = SpecStats()
        self._seqs: dict[int, _DraftSequence] = {}  # target slot -> its draft sequence

    @property
    def lookahead(self) -> int:
        """The most tokens a decode step appends to one sequence's tables (the scheduler reserves their blocks)."""
        return self.max_tokens + 1

    # ------------------------------------------------------------------ draft sequences
    def forget(self, target_slot: int) -> None:
        """The target sequence ended, was preempted or swapped out: its draft sequence goes (rebuilt when needed)."""
        ds = self._seqs.pop(target_slot, None)
        if ds is not None:
            self.draft.end_sequence(ds.slot)

    def adopt(self, target_slot: int, draft_slot: int, fed: int) -> None:
        """Use the draft engine's sequence `draft_slot` (holding the sequence's first `fed` tokens) as the draft of
        target sequence `target_slot` (a bench that prefilled both itself)."""
        self._seqs[target_slot] = _DraftSequence(draft_slot, fed, self.num_tokens)

    def forget_all(self) -> None:
        for slot in list(self._seqs):
            self.forget(slot)

    def _sequence(self, target_slot: int) -> _DraftSequence:
        ds = self._seqs.get(target_slot)
        if ds is None:
            ds = self._seqs[target_slot] = _DraftSequence(self.draft.new_sequence(), 0, self.num_tokens)
        return ds

    def follow_prefill(self, chunks: list[tuple[int, list[int], int, bool]]) -> None:
        """The target prefilled these (slot, token_ids, start_pos, last_chunk) chunks: the draft prefills the same
        ones in one ragged step where it is in step (else it catches up when the sequence drafts)."""
        segs, seqs = [], []
        for slot, ids, start, last in chunks:
            ds = self._seqs.get(slot) if start else self._sequence(slot)
            if ds is None or ds.fed != start:
                continue
            segs.append(Segment(ds.slot, list(ids), start, "prefill", last))
            seqs.append((slot, ds, len(ids)))
        if not segs:
            return
        t0 = time.perf_counter()
        try:
            self.draft.step(segs)
            self.draft.flush_pending_frees()  # a sliding draft window's evicted blocks, back to the draft pool
        except OutOfBlocksError:
            self.stats.draft_failures += 1
            for slot, _, _ in seqs:
                self.forget(slot)
            return
        finally:
            self.stats.draft_s += time.perf_counter() - t0
        for _, ds, n in seqs:
            ds.fed += n

    def _catch_up(self, slot: int, tokens: list[int], upto: int) -> _DraftSequence:
        """A draft sequence that holds nothing yet gets tokens[:upto] as a chunked prefill (after a preemption)."""
        ds = self._sequence(slot)
        if ds.fed == 0 and upto > 0:
            chunk = self.draft.prefill_chunk_size
            for a in range(0, upto, chunk):
                b = min(upto, a + chunk)
                self.draft.forward_chunk(ds.slot, tokens[a:b], a, last_chunk=b == upto, logits_for="none")
            ds.fed = upto
        return ds

    # ------------------------------------------------------------------ a round
    def _propose(self, items: list[DecodeItem], ks: list[int], temperature: float, top_p: float,
                 gen: torch.Generator) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
        """k one-token draft steps, batched over the sequences: (drafts, their distributions when sampling)."""
        drafts: list[list[int]] = [[] for _ in items]
        dists: list[list[torch.Tensor]] = [[] for _ in items]
        queues: list[list[int]] = []
        seqs: list[Optional[_DraftSequence]] = []
        for it, k in zip(items, ks):
            if k <= 0:
                queues.append([])
                seqs.append(None)
                continue
            try:
                ds = self._catch_up(it.slot, it.tokens, len(it.tokens) - 1)
            except OutOfBlocksError:
                self.stats.draft_failures += 1
                self.forget(it.slot)
                queues.append([])
                seqs.append(None)
                continue
            queues.append(list(it.tokens[ds.fed:]))
            seqs.append(ds)
        while True:
            active = [i for i, q in enumerate(queues) if q]
            if not active:
                break
            segs = [Segment(seqs[i].slot, [queues[i][0]], seqs[i].fed, "decode") for i in active]
            try:
                logits = self.draft.step(segs)
                self.draft.flush_pending_frees()
            except OutOfBlocksError:  # the draft pool is full: propose what there is
                self.stats.draft_failures += 1
                break
            for i, row in zip(active, logits):
                queues[i].pop(0)
                seqs[i].fed += 1
                if queues[i]:
                    continue  # still catching up
                if temperature > 0:
                    probs = sampling_probs(row[None], temperature, top_p)[0]
                    tok = int(torch.multinomial(probs, 1, generator=gen))
                    dists[i].append(probs)
                else:
                    tok = int(row.argmax())
                drafts[i].append(tok)
                if len(drafts[i]) < ks[i]:
                    queues[i].append(tok)
        return drafts, dists

    def decode(self, target: Any, items: list, temperature: float, top_p: float,
               gen: torch.Generator) -> list[list[int]]:
        """One speculative round for every item, a decoding sequence of the target engine given as a DecodeItem or
        (slot, tokens, remaining): returns the tokens each one emits (accepted drafts, then the target's own)."""
        items = [it if isinstance(it, DecodeItem) else DecodeItem(*it) for it in items]
        ks = []
        for it in items:
            ds = self._seqs.get(it.slot)
            k = ds.k if ds is not None else self.num_tokens
            ks.append(max(0, min(k, it.remaining - 1, target.cache.append_horizon(it.slot) - 1)))
        t0 = time.perf_counter()
        drafts, dists = self._propose(items, ks, temperature, top_p, gen)
        t1 = time.perf_counter()
        segs = [Segment(it.slot, [it.tokens[-1]] + d, len(it.tokens) - 1, "decode") for it, d in zip(items, drafts)]
        logits = target.step(segs, logits_for="all")  # [k_i + 1, V] each
        target.flush_pending_frees()
        out: list[list[int]] = []
        for it, d, q, lg in zip(items, drafts, dists, logits):
            if temperature > 0 and d:
                toks = rejection_sample(sampling_probs(lg, temperature, top_p), torch.stack(q), d, gen)
            elif temperature > 0:
                toks = [int(torch.multinomial(sampling_probs(lg[-1:], temperature, top_p)[0], 1, generator=gen))]
            else:
                toks = greedy_accept(lg, d)
            a = len(toks) - 1  # drafts accepted
            keep = len(it.tokens) + a  # positions < keep stay: the old tokens and the accepted drafts
            rollback(target, it.slot, keep)
            ds = self._seqs.get(it.slot)
            if ds is not None and ds.fed > keep:
                rollback(self.draft, ds.slot, keep)
                ds.fed = keep
            self._account(ds, len(d), a)
            out.append(toks)
        self.stats.draft_s += t1 - t0
        self.stats.verify_s += time.perf_counter() - t1
        return out

    def _account(self, ds: Optional[_DraftSequence], drafted: int, accepted: int) -> None:
        st = self.stats
        st.emitted_tokens += accepted + 1
        if not drafted:
            st.plain_steps += 1
            return
        st.rounds += 1
        st.draft_tokens += drafted
        st.accepted_tokens += accepted
        if self.adaptive and ds is not None:
            if accepted * 2 < drafted:
                ds.k = max(1, ds.k - 1)
            elif accepted == drafted:
                ds.k = min(self.max_tokens, ds.k + 1)

    def memory_stats(self) -> dict:
        """The draft cache's figures from its own pool (peak bytes beside the target's)."""
        mem = self.draft.memory_stats()
        return {"draft_peak_kv_bytes": mem["peak_kv_bytes"], "draft_kv_pool_bytes": mem["kv_pool_bytes"]}

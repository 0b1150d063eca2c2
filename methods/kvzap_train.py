"""`kvbench-train-kvzap`: train KVzap surrogates (linear and MLP) for any model against KVzip+ targets, as kvpress's
kvzap/train.py and kvzap/data.py do, on the packaged text (Paul Graham essays) instead of the Nemotron sample.

Targets (kvpress KVzapDataCollector): each text goes through the model as one chat, "user: <text>\\n\\nRepeat the
previous context exactly. assistant: <text>"; for every layer, a token of the first copy scores the largest, over
the second copy's queries and the query heads of its kv-head, of attention probability / ||h_query|| x
||W_o,head v_token||, and its target is the log of that (KVzip+). Its input is the layer's attention input at that
token. `n_tokens` tokens are drawn per text. The linear surrogate is a ridge regression per layer (sklearn Ridge's
defaults: alpha 1, intercept); the MLP (hidden_dim 512, GELU) is trained with AdamW (lr 5e-3, cosine schedule over
max_epochs 15, batch 512, gradient norm clipped at 1, MSE), kvpress's settings; 5% of the rows are held out and
the held-out MSE of both is printed. Output: <output_dir>/{linear,mlp} in the hub's format (methods/kvzap.py).

    kvbench-train-kvzap                                   # the packaged model, into the cache (what kvzap loads)
    kvbench-train-kvzap --model Qwen/Qwen3-8B --output-dir kvzap-qwen3 --device cuda
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch

from kvbench import atomic_write, data
from kvbench.console import say
from kvbench.errors import UserError
from kvbench.run.spec import DTYPE_ALIASES, DTYPES
from kvbench.methods.kvzap_surrogate import KVzapSurrogate, load_surrogate, packaged_folder
from kvbench.runtime.contract import NoCompression, Observation
from kvbench.runtime.measured_times import quoted
from kvbench.runtime.model.loading import load_model
from kvbench.runtime.serving.engine import Engine

REPEAT = "\n\nRepeat the previous context exactly."
# the packaged model's training run (CPU, minutes): kvpress uses 500 texts per subset of 750-1250 tokens, 500 each
PACKAGED_SETTINGS = dict(n_texts=12, min_tokens=400, max_tokens=600, n_tokens=200)


def repeat_prompt(tokenizer: Any, text: str) -> tuple[list[int], int, int, int, int]:
    """(ids, start, end of the text, start, end of its repeat) of the repeat chat (kvpress repeat_prompt_tokenization);
    with no chat template: text + REPEAT + "\\n" + text."""
    text = text.strip()
    if getattr(tokenizer, "chat_template", None) is None:
        a = list(tokenizer.encode(text, add_special_tokens=False))
        mid = list(tokenizer.encode(REPEAT + "\n", add_special_tokens=False))
        return a + mid + a, 0, len(a), len(a) + len(mid), 2 * len(a) + len(mid)
    messages = [{"role": "user", "content": text + REPEAT}, {"role": "assistant", "content": text}]
    chat = tokenizer.apply_chat_template(messages, tokenize=False)
    enc = tokenizer(chat, return_offsets_mapping=True, add_special_tokens=False)
    prefix, repeat, _ = chat.split(text)
    starts = [o[0] for o in enc["offset_mapping"]] + [len(chat)]

    def first_at(c: int) -> int:
        return next(i for i, s in enumerate(starts) if s >= c)

    a = len(prefix)
    b = a + len(text) + len(repeat)
    return (list(enc["input_ids"]), first_at(a), first_at(a + len(text)), first_at(b), first_at(b + len(text)))


class KVzipPlusCollector(NoCompression):
    """A hook that records, per layer, the attention input of the text's tokens and their KVzip+ log-scores."""

    acts_after_attention = True
    reads_hidden_states = True

    def __init__(self, model: Any):
        self.model = model
        self.span = (0, 0, 0, 0)
        self.h: dict[int, torch.Tensor] = {}  # layer -> [n, E]
        self.s: dict[int, torch.Tensor] = {}  # layer -> [H, n] max over the repeat queries so far

    def reset(self, span: tuple[int, int, int, int]) -> None:
        self.span, self.h, self.s = span, {}, {}

    def after_attention(self, ctx: Any) -> None:
        ps, pe, rs, re = self.span
        obs = Observation.of(ctx, 0, ctx.plan.slot_list[0], None)
        li = ctx.layer
        qpos = obs.step_query_positions  # [Q]
        hid = obs.hidden_states.float()  # [Q, E]
        inside = (qpos >= ps) & (qpos < pe)
        if bool(inside.any()):
            prev = self.h.get(li)
            cur = hid[inside]
            self.h[li] = cur if prev is None else torch.cat([prev, cur])
        rows = (qpos >= rs) & (qpos < re)
        if not bool(rows.any()):
            return
        q, k, v, kpos = obs.step_queries.float(), obs.keys.float(), obs.values.float(), obs.positions
        Hq, Q, D = q.shape
        H, T, _ = k.shape
        G = Hq // H
        logits = torch.einsum("hgqd,htd->hgqt", q.view(H, G, Q, D), k) * D ** -0.5  # [H, G, Q, T]
        seen = (kpos[:, None, None, :] <= qpos[None, None, :, None]) & obs.valid[:, None, None, :]
        probs = torch.softmax(logits.masked_fill(~seen, float("-inf")), dim=-1)
        probs = probs / hid.norm(dim=-1)[None, None, :, None]  # / ||h|| of the query's token
        w_o = self.model.layers[li].o.dense_weight().float()  # [E, Hq * D]
        w = w_o.view(-1, H, G, D).permute(1, 2, 3, 0)  # [H, G, D, E]
        wov = torch.einsum("htd,hgde->hgte", v, w).norm(dim=-1)  # [H, G, T] ||W_o,head v||
        probs = probs * wov[:, :, None, :]
        cols = (kpos >= ps) & (kpos < pe)  # [H, T]: the text's first copy (never evicted: its slots are in order)
        best = probs[:, :, rows].amax(dim=(1, 2))  # [H, T]
        n = pe - ps
        picked = best[cols].view(H, n)  # slots are positions here (nothing evicted)
        prev = self.s.get(li)
        self.s[li] = picked if prev is None else torch.maximum(prev, picked)


def collect(model: Any, tokenizer: Any, texts: list[str], n_tokens: int, seed: int = 0,
            progress: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """X [N, L, E] attention inputs and y [N, L, H] KVzip+ log-scores, n_tokens drawn per text (kvpress collect)."""
    hook = KVzipPlusCollector(model)
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    xs, ys = [], []
    for i, text in enumerate(texts):
        ids, ps, pe, rs, re = repeat_prompt(tokenizer, text)
        hook.reset((ps, pe, rs, re))
        blocks = cfg.num_layers * cfg.num_kv_heads * ((len(ids) + 1) // 16 + 2) + 8  # every token of every table
        engine = Engine(model, hook, prefill_chunk_size=len(ids) + 1, num_blocks=blocks, block_size=16,
                        max_num_batched_tokens=len(ids) + 1)
        out = engine.generate([ids], max_new_tokens=1)[0]
        if out.finish_reason == "failed":
            raise UserError(f"kvzap training: {out.error}")
        L = cfg.num_layers
        X = torch.stack([hook.h[li] for li in range(L)], dim=1)  # [n, L, E]
        y = torch.stack([torch.log(hook.s[li]).T for li in range(L)], dim=1)  # [n, L, H]
        pick = torch.randperm(X.shape[0], generator=g)[:n_tokens]
        xs.append(X[pick])
        ys.append(y[pick])
        if progress:
            print(f"kvzap: scored text {i + 1}/{len(texts)} ({len(ids)} tokens)", file=sys.stderr, flush=True)
    return torch.cat(xs), torch.cat(ys)


def train_linear(X: torch.Tensor, y: torch.Tensor, alpha: float = 1.0) -> KVzapSurrogate:
    """Per layer, ridge regression with an intercept (sklearn Ridge(alpha=1.0)'s solution, in closed form)."""
    N, L, E = X.shape
    net = KVzapSurrogate(E, y.shape[2], L, None)
    for li in range(L):
        x, t = X[:, li].double(), y[:, li].double()
        xm, tm = x.mean(0), t.mean(0)
        xc, tc = x - xm, t - tm
        W = torch.linalg.solve(xc.T @ xc + alpha * torch.eye(E, dtype=x.dtype), xc.T @ tc)  # [E, H]
        net.layers[li].weight.data = W.T.float().contiguous()
        net.layers[li].bias.data = (tm - xm @ W).float()
    return net


def train_mlp(X: torch.Tensor, y: torch.Tensor, hidden_dim: int = 512, max_epochs: int = 15, lr: float = 5e-3,
              batch_size: int = 512, device: str = "cpu", seed: int = 0) -> KVzapSurrogate:
    """kvpress train_mlp: AdamW, MSE, cosine annealing over the epochs, gradient norm clipped at 1."""
    torch.manual_seed(seed)
    N, L, E = X.shape
    net = KVzapSurrogate(E, y.shape[2], L, hidden_dim).to(device)
    opt = torch.optim.AdamW(net.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max_epochs)
    X, y = X.float().to(device), y.float().to(device)
    with torch.enable_grad():
        for _ in range(max_epochs):
            for b in torch.randperm(N, device=device).split(batch_size):
                loss = torch.nn.functional.mse_loss(net(X[b]), y[b])
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
                opt.step()
            sched.step()
    return net.cpu().eval()


def essay_texts(tokenizer: Any, n_texts: int, min_tokens: int, max_tokens: int, seed: int = 0) -> list[str]:
    """n_texts passages of the packaged essays, each between min_tokens and max_tokens tokens long."""
    ids = list(tokenizer.encode(data.essay_corpus_text(), add_special_tokens=False))
    g = torch.Generator().manual_seed(seed)
    out, at = [], 0
    while len(out) < n_texts:
        n = int(torch.randint(min_tokens, max_tokens + 1, (1,), generator=g))
        if at + n > len(ids):
            raise UserError(f"the packaged essays hold {len(out)} passages of {min_tokens}-{max_tokens} tokens, "
                            f"fewer than {n_texts}")
        out.append(tokenizer.decode(ids[at: at + n]))
        at += n
    return out


def train(model: Any, tokenizer: Any, output_dir: str | os.PathLike, *, n_texts: int, min_tokens: int,
          max_tokens: int, n_tokens: int, hidden_dim: int = 512, max_epochs: int = 15, lr: float = 5e-3,
          batch_size: int = 512, device: str = "cpu", progress: bool = True) -> dict:
    """Collect, fit both surrogates, write <output_dir>/{linear,mlp}; returns the held-out MSE of each."""
    if n_tokens >= min_tokens:
        raise UserError(f"n_tokens={n_tokens} must be below min_tokens={min_tokens} (kvpress)")
    texts = essay_texts(tokenizer, n_texts, min_tokens, max_tokens)
    X, y = collect(model, tokenizer, texts, n_tokens, progress=progress)
    keep = torch.isfinite(y).all(dim=(1, 2))
    X, y = X[keep], y[keep]
    if X.shape[0] < 2:
        raise UserError(f"kvzap training collected {X.shape[0]} usable samples; give more --n-texts or --n-tokens")
    n_test = max(1, int(0.05 * X.shape[0]))
    Xtr, ytr, Xte, yte = X[n_test:], y[n_test:], X[:n_test], y[:n_test]
    out = Path(output_dir)
    mse = {}
    nets = (("linear", train_linear(Xtr, ytr)),
            ("mlp", train_mlp(Xtr, ytr, hidden_dim, max_epochs, lr, batch_size, device)))
    for name, net in nets:
        with torch.no_grad():
            mse[name] = round(float(torch.nn.functional.mse_loss(net(Xte.float()), yte.float())), 4)
        if not all(bool(torch.isfinite(t).all()) for t in net.state_dict().values()):
            raise UserError(f"kvzap training fitted a {name} surrogate with NaN or inf weights (lr {lr}, "
                            f"{Xtr.shape[0]} samples); nothing written")
    for name, net in nets:  # both fitted and finite: written together
        net.save(out / name)
    mse["target_var"] = round(float(yte.float().var()), 4)
    return mse


def ensure_packaged(model: Any, tokenizer: Any, surrogate: str) -> KVzapSurrogate:
    """The packaged model's surrogate from the cache, trained there first if missing (announced with its time)."""
    folder = packaged_folder(surrogate)
    if (folder / "config.json").exists():
        return load_surrogate(str(folder))
    if tokenizer is None:
        raise UserError("kvzap needs the model's tokenizer to train its surrogate")
    root = folder.parent
    took = quoted("kvzap_train")
    say(f"kvbench: training KVzap surrogates for the packaged model into {root} (first use on this machine"
        + (f"; {took}" if took else "") + ")")
    t0 = time.perf_counter()
    with atomic_write.replaced(root, folder=True) as tmp:  # readers see no surrogates or all of them
        mse = train(model, tokenizer, tmp, progress=False, **PACKAGED_SETTINGS)
    say(f"kvbench: KVzap surrogates trained in {time.perf_counter() - t0:.0f} s (held-out MSE {mse})")
    return load_surrogate(str(folder))


def check_arguments(sizes: dict, *, hidden_dim: int, max_epochs: int, lr: float, batch_size: int,
                    dtype: str) -> None:
    """UserError (one line, before the model loads) for arguments that would train nothing or write NaN
    surrogates: counts below 1, --min-tokens above --max-tokens, --n-tokens not below --min-tokens, a learning rate
    that is not a positive finite number, an unknown dtype."""
    flags = {"n_texts": "--n-texts", "min_tokens": "--min-tokens", "max_tokens": "--max-tokens",
             "n_tokens": "--n-tokens"}
    counts = [(flags[k], sizes[k]) for k in flags] + [("--hidden-dim", hidden_dim), ("--max-epochs", max_epochs),
                                                      ("--batch-size", batch_size)]
    for flag, value in counts:
        if value < 1:
            raise UserError(f"invalid {flag} {value}: expected an integer >= 1")
    if sizes["min_tokens"] > sizes["max_tokens"]:
        raise UserError(f"invalid --min-tokens {sizes['min_tokens']}: above --max-tokens {sizes['max_tokens']}")
    if sizes["n_tokens"] >= sizes["min_tokens"]:
        raise UserError(f"invalid --n-tokens {sizes['n_tokens']}: must be below --min-tokens {sizes['min_tokens']} "
                        f"(kvpress draws that many tokens from each text)")
    if not (math.isfinite(lr) and lr > 0):
        raise UserError(f"invalid --lr {lr}: expected a positive finite number")
    if dtype not in DTYPES and dtype not in DTYPE_ALIASES:
        raise UserError(f"invalid --dtype {dtype!r}: choices are {', '.join(DTYPES)}")


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="kvbench-train-kvzap", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="hub id or folder (default: the packaged SmolLM2)")
    p.add_argument("--output-dir", default=None, help="where {linear,mlp} go (default for the packaged model: "
                   "the cache folder kvzap loads from)")
    p.add_argument("--n-texts", type=int, default=None)
    p.add_argument("--min-tokens", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--n-tokens", type=int, default=None, help="tokens drawn per text")
    p.add_argument("--hidden-dim", type=int, default=512)
    p.add_argument("--max-epochs", type=int, default=15)
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    a = p.parse_args(argv)
    try:
        out = a.output_dir
        if out is None:
            if a.model is not None:
                raise UserError("--output-dir is needed for a model other than the packaged one")
            out = str(packaged_folder("mlp").parent)
        if Path(out).exists() and not Path(out).is_dir():
            raise UserError(f"--output-dir {out!r} is a file; expected a folder (new or empty)")
        if Path(out).exists() and any(Path(out).iterdir()):
            raise UserError(f"--output-dir {out!r} is not empty")
        sizes = dict(PACKAGED_SETTINGS)
        for k in sizes:
            if getattr(a, k) is not None:
                sizes[k] = getattr(a, k)
        check_arguments(sizes, hidden_dim=a.hidden_dim, max_epochs=a.max_epochs, lr=a.lr, batch_size=a.batch_size,
                        dtype=a.dtype)
        loaded = load_model(a.model, dtype=a.dtype, device=a.device)
        t0 = time.perf_counter()
        mse = train(loaded.model, loaded.tokenizer, out, hidden_dim=a.hidden_dim, max_epochs=a.max_epochs, lr=a.lr,
                    batch_size=a.batch_size, device=a.device, **sizes)
    except UserError as exc:
        print(f"kvbench-train-kvzap: error: {exc}", file=sys.stderr)
        return 2
    print(f"kvbench-train-kvzap: {out}/linear and {out}/mlp written in {time.perf_counter() - t0:.0f} s; "
          f"held-out MSE {mse}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

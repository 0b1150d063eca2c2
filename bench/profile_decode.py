"""Where a CPU decode step's time goes: per-phase wall time of kvbench's fused decode layers, the LM head, and the
rest of the step (embedding lookup, final norm, sampling, scheduling, Python), per decode shape.

For each shape (batch 1 at each --contexts, and batch 16 at --batch16-context) the prompts are prefilled, then
--decode-tokens greedy steps run with the C kernel's phase clock on (kernels.PhaseClock: thread 0 reads the clock
at the barrier that ends each phase of each layer) and the LM head timed around its call. Milliseconds per decode
step, and each phase's share of the step, are printed; the last line is one JSON object
{"b1_ctx512": {"step_ms": ..., "phases_ms": {...}}, ...}.

    python bench/profile_decode.py [--contexts 512,4096] [--batch16-context 512] [--threads 2]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import time

PROJECTIONS = ("qkv", "o", "gate_up", "down")


class TimedLinear:
    """A Linear (or any callable) whose calls are timed: wall seconds summed in .seconds, and in .decode_seconds for
    the calls `is_decode(*args)` says belong to a decode step; everything else passes through."""

    def __init__(self, inner, is_decode=None):
        self.inner, self.seconds, self.decode_seconds = inner, 0.0, 0.0
        self.is_decode = is_decode

    def __call__(self, *args, **kwargs):
        t = time.perf_counter()
        y = self.inner(*args, **kwargs)
        dt = time.perf_counter() - t
        self.seconds += dt
        if self.is_decode is not None and self.is_decode(*args):
            self.decode_seconds += dt
        return y

    def __getattr__(self, name):
        return getattr(self.inner, name)


@contextlib.contextmanager
def op_by_op_timers(model, max_rows: int):
    """While on: each layer's projections wrapped in TimedLinear (kind -> the layers' timers) and the model's
    per-group attention timed (key "attention_and_kv_write"), their decode calls told apart from the prefill's (at
    most `max_rows` rows: the batch; a prefill chunk has more); the fused step never calls them, so they stay 0."""
    timers: dict[str, list[TimedLinear]] = {n: [] for n in PROJECTIONS}
    for lw in model.layers:
        for n in PROJECTIONS:
            timers[n].append(TimedLinear(getattr(lw, n), lambda x, *a: x.shape[0] <= max_rows))
            setattr(lw, n, timers[n][-1])
    attend = TimedLinear(model._attend_group, lambda li, lw, g, *a: g.tokens.shape[1] == 1)  # one query a sequence
    model._attend_group = attend  # an instance attribute: shadows the method for this model only
    timers["attention_and_kv_write"] = [attend]
    try:
        yield timers
    finally:
        del model._attend_group
        for n in PROJECTIONS:
            for lw, t in zip(model.layers, timers[n]):
                setattr(lw, n, t.inner)


def profile_shape(engine, model, ctx: int, batch: int, n: int, vocab: int) -> dict:
    """Decode `n` steps of `batch` random prompts of `ctx` tokens; per-step milliseconds by phase."""
    import torch

    from kvbench.runtime.backends.cpu import kernels

    g = torch.Generator().manual_seed(ctx + batch)
    prompts = [torch.randint(100, vocab - 100, (ctx,), generator=g).tolist() for _ in range(batch)]
    head = TimedLinear(model.lm_head)
    model.lm_head = head
    try:
        engine.generate(prompts, max_new_tokens=n + 1)  # warm-up: the pool's pages, buffers, thread choice
        head.seconds = 0.0
        with kernels.PhaseClock() as clock, op_by_op_timers(model, batch) as timers:
            gens = engine.generate(prompts, max_new_tokens=n + 1)
    finally:
        model.lm_head = head.inner
    steps = max(x.decode_tokens for x in gens)
    decode_s = max(x.decode_s for x in gens)
    # the LM head also ran once on the prefill's last rows: its decode share is steps / (steps + 1) of its time
    head_s = head.seconds * steps / (steps + 1)
    phases = {k: v / steps * 1e3 for k, v in clock.seconds().items()}
    if not any(phases.values()):  # not fused: the op-by-op timers' decode calls
        phases = {k: sum(t.decode_seconds for t in ts) / steps * 1e3 for k, ts in timers.items()}
    layers_ms = sum(phases.values())
    step_ms = decode_s / steps * 1e3
    phases["lm_head"] = head_s / steps * 1e3
    phases["outside_layers_and_head"] = step_ms - layers_ms - phases["lm_head"]
    return {"step_ms": step_ms, "tokens_per_s": batch * steps / decode_s, "phases_ms": phases}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", default="512,4096", help="batch-1 contexts, comma-separated")
    ap.add_argument("--batch16-context", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--model", default=None,
                    help="a GGUF file, its weights kept quantized (default: the packaged SmolLM2-135M in fp32)")
    ap.add_argument("--quant-activations", default="fp32", choices=("fp32", "q8"),
                    help="with --model: decode products with fp32 activations or rows quantized to Q8_0 blocks")
    args = ap.parse_args()

    from kvbench.runtime.backends.cpu.threads import configure_threads
    from kvbench.runtime.model.loading import load_model
    from kvbench.runtime.serving.engine import Engine
    import kvbench  # noqa: F401  (kvbench's OpenMP wait policy before torch loads)

    configure_threads(args.threads)
    model = (load_model(args.model, weights="quantized") if args.model else load_model(dtype="float32")).model
    if args.model:
        from kvbench.runtime.model.quantized_weights import set_quant_activations

        set_quant_activations(model, args.quant_activations)
    engine = Engine(model, prefill_chunk_size=512, prefix_caching=False, schedule="prefill_first")
    shapes = [(int(c), 1) for c in args.contexts.split(",") if c] + [(args.batch16_context, 16)]
    out = {}
    for ctx, batch in shapes:
        r = profile_shape(engine, model, ctx, batch, args.decode_tokens, model.config.vocab_size)
        out[f"b{batch}_ctx{ctx}"] = r
        parts = "  ".join(f"{k} {v:.2f} ({v / r['step_ms']:.0%})" for k, v in r["phases_ms"].items())
        print(f"batch {batch:2d} ctx {ctx:6d}  {r['tokens_per_s']:7.1f} tok/s  step {r['step_ms']:.2f} ms:  {parts}")
    print(json.dumps({k: {"step_ms": round(v["step_ms"], 3),
                          "phases_ms": {p: round(x, 3) for p, x in v["phases_ms"].items()}} for k, v in out.items()}))


if __name__ == "__main__":
    main()

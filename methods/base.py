"""The interface every compression method implements, the registry of methods by name (kvbench.registry.METHODS,
whose base class is set here) and `build_method`."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

from kvbench.errors import UserError
from kvbench.registry import METHODS, did_you_mean
from kvbench.runtime.contract import NoCompression
from kvbench.run.spec import check_budget, check_compression, check_positive


def latent_methods() -> list[str]:
    """The registered methods that declare `supports_latent` (their scores are defined on MLA's latent tokens)."""
    return [n for n in METHODS.names() if getattr(METHODS[n], "supports_latent", False)]


def latent_refusal(method: Any) -> Optional[str]:
    """Why `method` cannot run on an MLA model's latent cache, or None (its class's `supports_latent`, and its
    base's for a wrapper)."""
    name = getattr(method, "name", None)
    if not getattr(method, "supports_latent", False):
        return (f"method {name!r} scores key or value geometry that MLA's latent cache does not hold per head; "
                f"on an MLA model (DeepSeek-V2/V3) use one of {', '.join(latent_methods())}")
    base = getattr(method, "inner", None)  # a wrapper's base scorer (adakv)
    if base is not None and not getattr(base, "supports_latent", False):
        return f"method {name!r} over base {base.name!r}: " + latent_refusal(base)
    if method.store_pre_rope:
        return (f"method {name!r} caches keys before RoPE (position re-indexing): MLA's RoPE key sits inside the "
                f"latent row; use position_mode=original")
    return None


@dataclass
class Method(NoCompression):
    """A KV-cache compression method: which tokens stay (storage codecs are chosen with `quant=`).

    The engine calls (the hook protocol; the runtime knows nothing else of methods):
      attach(cache, model_config)   once, before any sequence
      after_attention(ctx)          after every layer's attention of every forward step (prefill chunks and
                                    decode steps) when `acts_after_attention`; evict here through the cache's
                                    named operations (keep_tokens, evict_blocks, drop_slots): the cache is a
                                    kvbench.runtime.cache.kv_eviction.MethodCacheView, and a method calls nothing
                                    else on it (tests/runtime/test_method_cache_surface.py); a method whose
                                    decode-step hook reads only the cache sets `decode_reads_attention = False`
                                    (ctx.q is then None in decode steps, and the call may come after the step)
      on_sequence_end(slot)         when a sequence's blocks are freed (finished or preempted)
      on_fork(parent, child)        when a sequence is forked (shared blocks): copy per-sequence state
    `budget` is the most KV tokens kept per sequence, per layer, per kv-head (None = unlimited).
    `compression_ratio` (exclusive with `budget`) is kvpress's knob: the fraction of each prompt's KV removed at
    prefill (0.0 = keep all); eviction methods turn it into a per-sequence budget (methods.eviction).
    `evicts` says whether the method ever drops tokens (False: the budget is meaningless and recorded as null;
    kvbench.run.spec reads it through the registry). `budget` and `compression_ratio` are checked once, by
    kvbench.run.spec (config.validate and build_method); a method checks only its own relations (sinks < budget).
    Every member of the protocol is declared once, with its default, on kvbench.runtime.hooks.NoCompression
    (docs/adding.md's table).
    """

    name: ClassVar[str] = "base"
    # Whether the scores are defined on MLA's latent tokens (one row per token, read by every query head: attention
    # mass over the latent row, positions, chance); False (the default) for scores of key or value geometry (norms,
    # similarity, value projections, RoPE statistics, calibrated heads) that the latent does not hold per head: such
    # a method is refused on an MLA model (docs/methods.md). A wrapper runs on MLA where it and its base both do.
    supports_latent: ClassVar[bool] = False
    budget: int | None = None
    compression_ratio: float | None = None

    def __post_init__(self) -> None:
        pass

    def check_model(self, model_config: Any) -> None:
        """UserError (one line) for a model this method cannot run on: an MLA model's latent cache where its scores
        are not defined. The engine asks before it builds the cache (the hook protocol's optional check_model)."""
        if getattr(model_config, "mla", None) is not None:
            why = latent_refusal(self)
            if why is not None:
                raise UserError(why)

    def attach(self, cache: Any, model_config: Any) -> None:
        """NoCompression's attach, after check_model."""
        self.check_model(model_config)
        super().attach(cache, model_config)

    def describe(self) -> dict[str, Any]:
        """The method's settings, recorded in every run's results."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


METHODS.set_base(Method)
register_method = METHODS.register


def available_methods() -> list[str]:
    return METHODS.names()


def build_method(name: str, budget: Optional[int] = None, *, seed: Optional[int] = None,
                 compression_ratio: Optional[float] = None, options_key: str = "method", budget_key: str = "budget",
                 **options: Any) -> Method:
    """Instantiate a method by name. `budget` and `compression_ratio` are the top-level knobs (one of them);
    `seed` (the run's top-level seed) reaches methods with a `seed` option left null. Unknown names and options
    raise UserError naming the choices; budget and compression_ratio are checked by kvbench.run.spec. A method built
    inside another (a wrapper's base, quest's eviction) passes where its options and budget come from
    (`options_key="method.base_options"`, `budget_key="method.evict_budget"`), so an error names that knob."""
    cls = METHODS.get(name)
    fields = {f.name for f in dataclasses.fields(cls) if f.init} - {"budget", "compression_ratio"}
    bad = sorted(set(options) - fields)
    if bad:
        valid = ", ".join(sorted(fields)) or "(none)"
        raise UserError(f"unknown option {options_key}.{bad[0]} for method {name!r}; valid options are {valid}"
                        f"{did_you_mean(bad[0], fields)}")
    if "seed" in fields and options.get("seed") is None and seed is not None:
        options["seed"] = seed
    if budget_key != "budget":
        check_positive(budget_key, budget, allow_none=True)
    compression_ratio = check_compression(check_budget(budget), compression_ratio)
    try:
        if compression_ratio is not None:
            options["compression_ratio"] = compression_ratio
        return cls(budget=budget, **options)
    except (TypeError, ValueError) as exc:
        raise UserError(f"invalid settings for method {name!r}: {exc}") from None

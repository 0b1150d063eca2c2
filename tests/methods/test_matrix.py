"""Every method x budgets x block sizes x prefill modes on a tiny random Llama.

After every after_attention call (every layer of every prefill chunk and decode step) the test checks:
  * tokens kept per (sequence, layer, kv-head) <= budget once the method is due to have evicted
    (+ block_size - 1, the filling block, for block-level methods while decoding; + decode_overshoot() for a
    method that has one: rkv's staging buffer); for a method whose
    budget_scope is "layer" (head-adaptive) the layer's tables hold <= kv_heads x budget together, for "sequence"
    all the sequence's tables <= layers x kv_heads x budget; a table with no table_budget (a DuoAttention
    retrieval head) is unbounded. A method that evicts after the step (after_prefill_chunk: kvzip) is checked
    there; calls made during the method's own passes (`reconstructing`) are not checked;
  * blocks in use == sum of ceil(len / block_size) over every live table (evicted blocks are freed);
  * each table's positions are strictly increasing (slot order = position order, no duplicates).
After the run: the pool holds no block and the method holds no per-sequence state. A budget at
or above the sequence length gives exactly the tokens and log-probabilities of `full`.
"""
from __future__ import annotations

import pytest
import torch

from kvbench.errors import UserError
from tests.fixtures.task_fixtures import one_thread as _one_thread
from tests.methods.variants import VARIANTS, budgeted, rotated
from tests.tiny_models import ByteTokenizer, tiny_model
from kvbench.methods import available_methods, build_method
from kvbench.runtime.hooks import NoCompression
from kvbench.runtime.serving.engine import Engine
from kvbench.runtime.serving.scoring import Scorer

CHUNK = 32
NEW_TOKENS = 20
PROMPT_LENGTHS = (70, 101)
BUDGETS = (32, 45)
BLOCK_SIZES = (8, 16)
NUM_BLOCKS = 2048  # the default pool (4 GiB) would mean millions of tiny blocks to list


def test_every_eviction_method_is_in_the_matrix():
    from kvbench.methods import METHODS
    from kvbench.methods.eviction import EvictionMethod

    eviction = {n for n in available_methods() if issubclass(METHODS[n], EvictionMethod)}
    assert eviction >= {"streaming_llm", "h2o", "paged_eviction", "kvcrush", "snapkv", "key_diff", "adakv",
                        "criticalkv", "duo_attention", "kvzip"}
    retrieval = {n for n in available_methods() if getattr(METHODS[n], "retrieves", False)}
    assert retrieval >= {"quest"}
    assert {name for name, _ in VARIANTS} == eviction | retrieval | {"full"}


one_thread = pytest.fixture(scope="module", autouse=True)(_one_thread)


@pytest.fixture(scope="module")
def model():
    # kvzip writes its reconstruction prompt with the tokenizer
    return tiny_model(vocab=256, max_positions=512, tokenizer=ByteTokenizer(256))


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def _over_budget(method, cache, slot: int, layer: int | None, budget: int, extra: int) -> str | None:
    """Why the tables of `slot` (one layer, or all with layer=None) exceed the method's budget, or None."""
    scope = getattr(method, "budget_scope", "table")
    L, H = cache.num_layers, cache.num_kv_heads
    layers = range(L) if layer is None else [layer]
    if scope == "sequence":
        total = int(cache.lengths[slot].sum())
        return None if total <= L * H * (budget + extra) else f"sequence holds {total} > {L} x {H} x {budget}"
    for li in layers:
        lengths = cache.lengths[slot, li].tolist()  # [H]
        if scope == "layer":
            if sum(lengths) > H * (budget + extra):
                return f"layer {li} holds {sum(lengths)} > {H} x {budget}"
            continue
        for h, n in enumerate(lengths):
            tb = method.table_budget(li, h) if hasattr(method, "table_budget") else budget
            if tb is not None and n > tb + extra:
                return f"{n} tokens > {tb + extra} (layer {li}, head {h})"
    return None


def _budgeted_size(method, cache, slot: int, layer: int) -> int:
    """The most tokens per table of what the budget bounds: a table with a budget, a layer's or the sequence's
    tables on average (head-adaptive methods split them unevenly)."""
    scope = getattr(method, "budget_scope", "table")
    lengths = cache.lengths[slot, layer]  # [H]
    if scope == "sequence":
        return -(-int(cache.lengths[slot].sum()) // cache.lengths[slot].numel())
    if scope == "layer":
        return -(-int(lengths.sum()) // lengths.numel())
    sizes = [int(n) for h, n in enumerate(lengths)
             if not hasattr(method, "table_budget") or method.table_budget(layer, h) is not None]
    return max(sizes, default=0)


def _overrides(method, member: str) -> bool:
    """Whether `method` defines its own `member` of the protocol (not NoCompression's default); quest forwards its
    eviction's hooks, so for quest whether that eviction (`inner`, None without one) does."""
    if method.name == "quest":
        return method.inner is not None and _overrides(method.inner, member)
    return getattr(type(method), member) is not getattr(NoCompression, member)


class Checker:
    """Wraps method.after_attention with the invariants; records the most tokens seen in a table."""

    def __init__(self, method, budget: int | None, block_size: int):
        self.method, self.budget, self.bs = method, budget, block_size
        self.block_level = getattr(method, "granularity", "token") == "block"
        self.after_step = _overrides(method, "after_prefill_chunk")  # evicts after the prefill step (kvzip)
        self.calls = 0
        self.max_kept = 0  # most tokens in a table after the method ran
        self.max_before = 0  # most tokens in a budgeted table (see _budgeted_size) when the method was called
        self.final_lengths: list[int] = []
        inner = method.after_attention

        def after_attention(ctx):
            if getattr(method, "reconstructing", False):  # the method's own pass (kvzip's reconstruction)
                return inner(ctx)
            for slot in ctx.plan.slots.tolist():
                self.max_before = max(self.max_before, _budgeted_size(method, ctx.cache, slot, ctx.layer))
            inner(ctx)
            self.check(ctx)

        method.after_attention = after_attention
        method.acts_after_attention = True  # call it even for methods that never act (full)
        if self.after_step:
            inner_after = method.after_prefill_chunk

            def after_prefill_chunk(slot, token_ids, start_pos, last_chunk):
                reentrant = getattr(method, "reconstructing", False)
                inner_after(slot, token_ids, start_pos, last_chunk)
                due = last_chunk or getattr(method, "prefill_mode", None) == "streaming"
                if not reentrant and due and self.budget is not None:
                    why = _over_budget(method, method.engine.cache, slot, None, self.budget, 0)
                    assert why is None, f"{method.name}: {why} (after the prefill step)"

            method.after_prefill_chunk = after_prefill_chunk

    def check(self, ctx) -> None:
        self.calls += 1
        cache, bs = ctx.cache, self.bs
        evicts_in_decode = getattr(self.method, "decode", "none") != "none"
        compresses_prompt = getattr(self.method, "compresses_prompt", True)  # False: decoding compresses (decoding)
        due = ((ctx.phase == "decode" and evicts_in_decode)
               or (ctx.phase == "prefill" and not self.after_step and compresses_prompt
                   and (ctx.last_chunk or getattr(self.method, "prefill_mode", None) == "streaming")))
        for slot in ctx.plan.slots.tolist():
            lengths = cache.lengths[slot, ctx.layer]  # [H]
            n = int(lengths.max())
            self.max_kept = max(self.max_kept, n)
            holds = getattr(self.method, "budget_holds", None)  # bounded only once compressed while decoding
            if self.budget is not None and self.method.name != "full" and due and (holds is None
                                                                                  or holds(slot, ctx.layer)):
                extra = bs - 1 if self.block_level and ctx.phase == "decode" else 0
                if ctx.phase == "decode" and _overrides(self.method, "decode_overshoot"):  # rkv's staging buffer
                    extra = self.method.decode_overshoot()
                why = _over_budget(self.method, cache, slot, ctx.layer, self.budget, extra)
                assert why is None, f"{self.method.name}: {why} ({ctx.phase}, layer {ctx.layer})"
            for h in range(lengths.shape[0]):
                pos = cache.positions[slot, ctx.layer, h, : int(lengths[h])]
                assert bool((pos[1:] > pos[:-1]).all()), "positions not strictly increasing"
                assert int(pos.min()) >= 0
        want = sum(int(((cache.lengths[s] + bs - 1) // bs).sum()) for s in cache.live)
        assert (cache.host_lengths[list(cache.live)] == cache.lengths[list(cache.live)].numpy()).all()
        # blocks a decode step evicted on the device return to the pool with the step's sampled tokens
        want += cache.pending_free_count()
        assert cache.pool.in_use == want, f"{cache.pool.in_use} blocks in use, tables need {want}"


def _run(model, prompts, name, opts, budget, bs, mode=None):
    if mode is not None and name != "full":
        opts = {**opts, "prefill_mode": mode}
    method = build_method(name, budget, **opts)
    checker = Checker(method, budget, bs)
    engine = Engine(model, method, block_size=bs, prefill_chunk_size=CHUNK, num_blocks=NUM_BLOCKS)
    gens = engine.generate(prompts, max_new_tokens=NEW_TOKENS)
    logprobs = Scorer(engine).score(prompts[1], chunk_size=CHUNK)
    assert engine.cache.pool.in_use == 0
    engine.cache.pool.check_consistency()
    assert not getattr(method, "_state", {}), "per-sequence state left after the sequences ended"
    return gens, logprobs, engine, checker


# each variant in one prefill mode at one budget and block size by default (the combinations rotate over the
# variants: variants.rotated); every combination of every variant under `make test-all`
MODE_BUDGET_BLOCK = [(mode, budget, bs) for mode in ("paper", "streaming") for budget, bs in ((32, 8), (45, 16),
                                                                                              (32, 16), (45, 8))]


@pytest.mark.parametrize("variant,mode,budget,bs", rotated(budgeted(VARIANTS), MODE_BUDGET_BLOCK,
                                                           ("mode", "budget", "bs")))
def test_budget_and_blocks_hold_after_every_step(model, prompts, variant, mode, budget, bs):
    name, opts = variant
    if name == "full" and (mode, budget) != ("paper", BUDGETS[0]):
        pytest.skip("full ignores prefill_mode and budget")
    if name == "quest":
        pytest.skip("retrieval keeps every token (tests/methods/test_quest.py)")
    gens, logprobs, engine, checker = _run(model, prompts, name, opts, budget, bs, mode)
    assert checker.calls > 0
    assert all(len(g.token_ids) == NEW_TOKENS for g in gens)
    assert bool(torch.isfinite(logprobs).all())
    full_tokens = max(PROMPT_LENGTHS) + NEW_TOKENS - 1  # the last token is never fed back
    if name == "full":
        assert checker.max_kept == full_tokens
        return
    # the cache was compressed, and memory measured from the pool shows it
    stats = engine.memory_stats()
    if name in ("kvzip", "kvcompose"):  # its peak holds a reconstruction chunk (a scratch pass, not counted in
        # full_kv_bytes), which can pass an uncompressed cache's size: what the tables held once compressed shows
        # the saving
        assert stats["held_kv_bytes"] < stats["full_kv_bytes"]
    else:
        assert stats["peak_kv_bytes"] < stats["full_kv_bytes"]
    if not getattr(engine.method, "budget_bounds_tables", True):  # lukv: a budget curve sizes the tables
        assert engine.method.curve is not None
    elif not getattr(engine.method, "compresses_prompt", True):  # decoding: the prompt and the first interval's tokens
        assert checker.max_before == max(PROMPT_LENGTHS) + engine.method.compression_interval
    elif mode == "paper":
        assert checker.max_before == max(PROMPT_LENGTHS)  # the whole prompt attended, then evicted
    else:  # streaming: the peak stays within the budget (the largest layer budget) plus one chunk
        method = engine.method
        if hasattr(method, "layer_budget"):  # layer budgets grow with the tokens seen: the prompt's are the largest
            budget = max(method.layer_budget(layer, max(PROMPT_LENGTHS)) for layer in range(engine.cache.num_layers))
        assert checker.max_before <= budget + CHUNK


@pytest.mark.parametrize("variant,bs", rotated(budgeted(VARIANTS), [(bs,) for bs in BLOCK_SIZES], ("bs",)))
def test_tables_use_the_budget_while_decoding(model, prompts, variant, bs):
    """Methods evict no more than they must: at the end of decoding every table is full to the budget
    (token-level) or within one block below it (block-level)."""
    name, opts = variant
    if name in ("full", "quest"):
        pytest.skip("full and quest (retrieval) keep everything")
    budget = 40
    method = build_method(name, budget, **opts)
    if method.decode == "none":
        pytest.skip("decode=none appends generated tokens (test_decode_none_keeps_...)")
    seen = {}
    inner = method.on_sequence_end

    def on_sequence_end(slot):
        seen[slot] = engine.cache.lengths[slot].clone()  # [L, H] before the tables are freed
        inner(slot)

    method.on_sequence_end = on_sequence_end
    engine = Engine(model, method, block_size=bs, prefill_chunk_size=CHUNK, num_blocks=NUM_BLOCKS)
    engine.generate(prompts, max_new_tokens=NEW_TOKENS)
    assert len(seen) == len(prompts)
    for lengths in seen.values():
        if method.budget_scope != "table":  # head-adaptive: each layer's tables hold the layer's budget together
            H, over = lengths.shape[-1], method.decode_overshoot()
            held = lengths.sum(-1)  # [L]; decoding compresses every interval: at most H x (budget + overshoot)
            assert bool((held >= H * budget).all() and (held <= H * (budget + over)).all()), lengths
            continue
        budgeted = torch.tensor([[method.table_budget(li, h) is not None for h in range(lengths.shape[1])]
                                 for li in range(lengths.shape[0])])
        lengths = lengths[budgeted]  # tables with no per-table bound (retrieval heads) keep every token
        if method.granularity == "block":
            assert int(lengths.min()) > budget - bs and int(lengths.max()) < budget + bs
        elif _overrides(method, "decode_overshoot"):  # rkv: compressed to budget whenever budget + buffer is reached
            assert int(lengths.min()) >= budget and int(lengths.max()) <= budget + method.decode_overshoot()
        else:
            assert bool((lengths == budget).all()), lengths


@pytest.mark.parametrize("variant,bs", rotated(budgeted(VARIANTS), [(bs,) for bs in reversed(BLOCK_SIZES)], ("bs",)))
def test_budget_above_sequence_length_equals_full_cache(model, prompts, variant, bs):
    name, opts = variant
    budget = 4096
    if build_method(name, budget, **opts).pruned_key_channels(model.config.head_dim):
        pytest.skip("prunes key channels at any budget (ThinK at ratio 0 equals full: tests/methods/test_think.py)")
    ref_gens, ref_lp, _, _ = _run(model, prompts, "full", {}, None, bs)
    gens, lp, _, checker = _run(model, prompts, name, opts, budget, bs)
    assert [g.token_ids for g in gens] == [g.token_ids for g in ref_gens]
    method = build_method(name, budget, **opts)
    if getattr(method, "needs_key_scores", False) or method.store_pre_rope:
        # attention probabilities materialised / keys rotated at read time: same math, other kernels
        torch.testing.assert_close(lp, ref_lp, atol=2e-5, rtol=0)
    else:
        assert torch.equal(lp, ref_lp)
    assert checker.max_kept == max(PROMPT_LENGTHS) + NEW_TOKENS - 1


@pytest.mark.parametrize("name", ["paged_eviction", "key_diff"])
def test_block_methods_reject_budgets_below_two_blocks(model, name):
    with pytest.raises(UserError, match="budget >= 32"):
        Engine(model, build_method(name, 31), block_size=16, num_blocks=NUM_BLOCKS)
    Engine(model, build_method(name, 16, protect_first_block=False, prefill_keep_first_block=False),
           block_size=16, num_blocks=NUM_BLOCKS)


@pytest.mark.parametrize("name", ["streaming_llm", "h2o", "paged_eviction", "kvcrush", "snapkv", "key_diff",
                                  "adakv", "criticalkv", "duo_attention", "kvzip"])
def test_methods_need_a_budget_and_validate_options(name):
    with pytest.raises(UserError, match="needs a budget"):
        build_method(name, None)
    with pytest.raises(UserError, match="prefill_mode"):
        build_method(name, 64, prefill_mode="lazy")


@pytest.mark.parametrize("name,opts,match", [
    ("streaming_llm", {"sinks": 64}, "budget must exceed sinks"),
    ("streaming_llm", {"position_mode": "shifted"}, "position_mode"),
    ("h2o", {"recent_ratio": 1.5}, "recent_ratio"),
    ("paged_eviction", {"heads": "all"}, "heads"),
    ("kvcrush", {"r": -0.1}, "kvcrush.r"),
    ("kvcrush", {"anchor": "median"}, "anchor"),
    ("kvcrush", {"importance": "tova"}, "importance"),
    ("snapkv", {"kernel_size": 4}, "kernel_size"),
    ("snapkv", {"decode": "slide"}, "snapkv.decode"),
    ("h2o", {"decode": "block"}, "h2o.decode"),
    ("snapkv", {"pooling": "median"}, "pooling"),
    ("key_diff", {"protect_first_block": "yes"}, "protect_first_block"),
    ("adakv", {"base": "kvcrush"}, "adakv.base"),
    ("criticalkv", {"head_adaptive": "yes"}, "head_adaptive"),
    ("duo_attention", {"on_the_fly": True, "head_compression_ratio": 1.5}, "head_compression_ratio"),
    ("kvzip", {"decode": "evict"}, "kvzip.decode"),
    ("kvzip", {"chunk_size": 0}, "chunk_size"),
])
def test_bad_options_name_the_value(name, opts, match):
    with pytest.raises(UserError, match=match):
        build_method(name, 64, **opts)


@pytest.mark.parametrize("name", ["streaming_llm", "h2o", "paged_eviction", "kvcrush", "snapkv", "key_diff",
                                  "adakv", "criticalkv", "kvzip"])
def test_method_yaml_composes_to_the_dataclass_defaults(name):
    """conf/method/<name>.yaml through Hydra and config.validate builds the method with its documented defaults,
    and an override on the command line reaches the method."""
    from kvbench.run.config import validate
    from kvbench.methods import METHODS
    from tests.harness_fakes import compose

    s = validate(compose([f"method={name}", "budget=256"]))
    assert s.method_name == name
    method = build_method(s.method_name, s.budget, **s.method_options)
    assert method == METHODS[name](budget=256)
    s = validate(compose([f"method={name}", "budget=256", "method.prefill_mode=streaming"]))
    assert build_method(s.method_name, s.budget, **s.method_options).describe()["prefill_mode"] == "streaming"


EVICTION_METHODS = ["streaming_llm", "h2o", "paged_eviction", "kvcrush", "snapkv", "key_diff"]


@pytest.mark.parametrize("name", EVICTION_METHODS)
def test_decode_none_keeps_prefill_tokens_and_every_generated_token(model, prompts, name):
    """method.decode=none: after prefill nothing leaves; 32 decode steps append 32 tokens to every table."""
    budget, bs, steps = 40, 8, 32
    method = build_method(name, budget, decode="none")
    after_prefill, at_end = {}, {}
    inner_after, inner_end = method.after_attention, method.on_sequence_end

    def after_attention(ctx):
        inner_after(ctx)
        if ctx.phase == "prefill" and ctx.last_chunk:
            for i, slot in enumerate(ctx.plan.slots.tolist()):
                prompt_len = int(ctx.plan.query_positions[i, -1]) + 1
                after_prefill[(slot, ctx.layer)] = (prompt_len, _kept_positions(ctx.cache, slot, ctx.layer))

    def on_sequence_end(slot):
        for layer in range(engine.cache.num_layers):
            at_end[(slot, layer)] = _kept_positions(engine.cache, slot, layer)
        inner_end(slot)

    method.after_attention, method.on_sequence_end = after_attention, on_sequence_end
    engine = Engine(model, method, block_size=bs, prefill_chunk_size=CHUNK, num_blocks=NUM_BLOCKS)
    gens = engine.generate(prompts, max_new_tokens=steps + 1)  # the last token is never fed back
    assert [len(g.token_ids) for g in gens] == [steps + 1] * len(prompts)
    assert set(at_end) == set(after_prefill) and len(at_end) == len(prompts) * engine.cache.num_layers
    for key, (slot_prompt, heads) in after_prefill.items():
        assert all(len(h) <= budget for h in heads), "prefill did not compress"
        generated = set(range(slot_prompt, slot_prompt + steps))
        for before, after in zip(heads, at_end[key]):
            assert set(after) == set(before) | generated


def _kept_positions(cache, slot, layer):
    """Original positions held by each kv-head table of one sequence's layer: list over heads of lists."""
    lengths = cache.lengths[slot, layer]
    return [cache.positions[slot, layer, h, : int(lengths[h])].tolist() for h in range(lengths.shape[0])]

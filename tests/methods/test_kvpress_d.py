"""Issue 69's presses (kvpress's evaluation registry beyond the board): observed_attention, block_keydiff and qfilter
keep exactly the tokens of kvpress's presses (ObservedAttentionPress, BlockPress(KeyDiffPress), QFilterPress),
written out here in plain torch from a transformers model's own attention probabilities, keys and hidden states;
prefill in one chunk or several."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from huggingface_hub import PyTorchModelHubMixin

from kvbench.errors import UserError
from kvbench.methods import METHODS, build_method
from kvbench.methods.qfilter import hub_id, load_q_filters, save_q_filters
from tests.fixtures.press_fixtures import PROMPT_TOKENS, assert_question_appended_whole, hf, hf_out, ids  # noqa: F401  (fixtures)
from tests.fixtures.task_fixtures import one_thread as _one_thread
from tests.methods.test_kvpress_a import kept_after_prefill, layer_kv, top_sets

T, BUDGET = PROMPT_TOKENS, 120

one_thread = pytest.fixture(scope="module", autouse=True)(_one_thread)


# ------------------------------------------------------------------------------------------------ definitions
def observed_attention_reference(out, layer: int, budget: int) -> list[set]:
    """kvpress ObservedAttentionPress.score: the prompt's attention summed over the queries, / (n_tokens - i), the
    GQA group averaged."""
    probs = out.attentions[layer][0].float()  # [Hq, T, T]
    n = probs.shape[-1]
    H = out.past_key_values.layers[layer].keys.shape[1]
    s = probs.sum(1) / torch.arange(n, 0, -1, dtype=torch.float32)  # [Hq, T]
    s = s.view(H, -1, n).mean(1)  # [H, T]
    return top_sets(s, budget)


def block_keydiff_reference(out, layer: int, n_kept: int, block_size: int) -> list[set]:
    """kvpress BlockPress(press=KeyDiffPress()).compress: the first n_kept tokens, then each next block scored with
    them (anchor = the mean normalised key of that set), the n_kept best kept."""
    k, _ = layer_kv(out, layer)  # [H, T, D]
    H, n, D = k.shape
    block = block_size if block_size < n else n
    kept = torch.arange(n_kept).expand(H, -1)
    for i in range(n_kept, n, block):
        current = torch.cat([kept, torch.arange(i, min(i + block, n)).expand(H, -1)], dim=-1)
        keys = k.gather(1, current[..., None].expand(-1, -1, D))
        anchor = F.normalize(keys, p=2, dim=-1).mean(dim=1, keepdim=True)
        scores = -F.cosine_similarity(keys, anchor, dim=-1)
        kept = current.gather(-1, scores.topk(n_kept, dim=-1).indices)
    return [set(row.tolist()) for row in kept]


def qfilter_reference(out, layer: int, budget: int, filters: torch.Tensor) -> list[set]:
    """kvpress QFilterPress.score: -(q_filter[layer] * keys).sum(-1) over the post-RoPE keys."""
    k, _ = layer_kv(out, layer)  # [H, T, D]
    return top_sets(-(filters[layer][:, None, :] * k).sum(-1), budget)


# ------------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("chunk", [T, 64])
def test_observed_attention_keeps_the_mean_observed_attention(hf, ids, hf_out, chunk):
    kept, _ = kept_after_prefill(hf, ids, build_method("observed_attention", BUDGET), chunk)
    for layer in range(2):
        assert kept[layer] == observed_attention_reference(hf_out, layer, BUDGET), f"layer {layer}"


def test_observed_attention_is_not_h2os_sum(hf, ids, hf_out):
    """The division by the observing queries matters: the attention sum alone (H2O's score) keeps other tokens."""
    probs = hf_out.attentions[0][0].float()
    H = hf_out.past_key_values.layers[0].keys.shape[1]
    summed = top_sets(probs.sum(1).view(H, -1, T).mean(1), BUDGET)
    assert summed != observed_attention_reference(hf_out, 0, BUDGET)


@pytest.mark.parametrize("block_size", [128, 32, 1000])
@pytest.mark.parametrize("chunk", [T, 64])
def test_block_keydiff_keeps_blockpress_keydiffs_tokens(hf, ids, hf_out, block_size, chunk):
    kept, _ = kept_after_prefill(hf, ids, build_method("block_keydiff", BUDGET, block_size=block_size), chunk)
    for layer in range(2):
        assert kept[layer] == block_keydiff_reference(hf_out, layer, BUDGET, block_size), f"layer {layer}"


def test_block_keydiff_with_a_compression_ratio_keeps_kvpress_count(hf, ids, hf_out):
    kept, _ = kept_after_prefill(hf, ids, build_method("block_keydiff", None, compression_ratio=0.6), T)
    n_kept = int(T * (1 - 0.6))
    assert kept[1] == block_keydiff_reference(hf_out, 1, n_kept, 128)


def test_block_keydiff_differs_from_one_pass_keydiff(hf_out):
    """The block-wise iteration matters: KeyDiff over the whole prompt at once keeps other tokens."""
    k, _ = layer_kv(hf_out, 0)
    anchor = F.normalize(k, p=2, dim=-1).mean(dim=1, keepdim=True)
    one_pass = top_sets(-F.cosine_similarity(k, anchor, dim=-1), BUDGET)
    assert one_pass != block_keydiff_reference(hf_out, 0, BUDGET, 32)


class QFilters(torch.nn.Module, PyTorchModelHubMixin):
    """kvpress's QFilters module: what the hub's filters are saved from (PyTorchModelHubMixin.save_pretrained)."""

    def __init__(self, num_layers: int, num_kv_heads: int, kv_head_dim: int):
        super().__init__()
        self.q_filters = torch.nn.Parameter(torch.randn(num_layers, num_kv_heads, kv_head_dim))


@pytest.fixture(scope="module")
def hub_filters(hf, tmp_path_factory):
    """Q-filters for the tiny model, written by huggingface_hub's mixin as the hub's repositories are."""
    cfg = hf.config
    torch.manual_seed(5)
    module = QFilters(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads)
    folder = tmp_path_factory.mktemp("qfilt") / "Tiny_qfilt"
    module.save_pretrained(folder)
    return folder, module.q_filters.detach().clone()


@pytest.mark.parametrize("chunk", [T, 64])
def test_qfilter_keeps_the_filters_top_tokens(hf, ids, hf_out, hub_filters, chunk):
    folder, filters = hub_filters
    kept, _ = kept_after_prefill(hf, ids, build_method("qfilter", BUDGET, path=str(folder)), chunk)
    for layer in range(2):
        assert kept[layer] == qfilter_reference(hf_out, layer, BUDGET, filters), f"layer {layer}"


def test_qfilter_files_round_trip_in_the_hubs_format(hub_filters, tmp_path):
    """kvbench's writer and reader agree with the mixin's: what save_q_filters writes, QFilters.from_pretrained
    reads, and load_q_filters reads what the mixin wrote."""
    folder, filters = hub_filters
    assert torch.equal(load_q_filters(str(folder)), filters)
    save_q_filters(filters * 2, tmp_path / "mine")
    assert torch.equal(QFilters.from_pretrained(tmp_path / "mine").q_filters.detach(), filters * 2)


def test_qfilter_hub_name_is_kvpresss():
    assert hub_id("meta-llama/Meta-Llama-3.1-8B-Instruct") == "nthngdy/Llama-3.1-8B-Instruct_qfilt"
    assert hub_id("meta-llama/Meta-Llama-3.1-405B-Instruct") == "nthngdy/Meta-Llama-3.1-405B-Instruct_qfilt"
    assert hub_id("Qwen/Qwen3-8B") == "nthngdy/Qwen3-8B_qfilt"


def test_qfilter_refuses_missing_or_misfit_filters_in_one_line(hf, ids, tmp_path):
    from kvbench.runtime.model.families import build_from_transformers
    from kvbench.runtime.serving.engine import Engine

    with pytest.raises(UserError, match="no such folder"):
        load_q_filters(str(tmp_path / "absent"))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{}")
    with pytest.raises(UserError, match="hub's format"):
        load_q_filters(str(tmp_path / "broken"))
    save_q_filters(torch.zeros(3, 2, 16), tmp_path / "three_layers")
    with pytest.raises(UserError, match="do not fit"):
        Engine(build_from_transformers(hf), build_method("qfilter", BUDGET, path=str(tmp_path / "three_layers")),
               block_size=16, num_blocks=64)
    model = build_from_transformers(hf)  # no name_or_path: the packaged model has no published filters
    with pytest.raises(UserError, match="method.path"):
        Engine(model, build_method("qfilter", BUDGET), block_size=16, num_blocks=64)


def decoding_qfilter_reference(keys: torch.Tensor, filters: torch.Tensor, prompt: int, steps: int, target: int,
                               interval: int) -> list[set]:
    """kvpress DecodingPress(QFilterPress()) on one layer: keys [H, T, D] of prompt + fed tokens (their own keys, as
    layer 0's do not depend on the cache), filters [H, D]; nothing at prefill; after every decode step the step count
    grows and at `interval` the cache over `target` keeps its `target` best -<filter, key> per head (count reset
    either way). (Q-filters rather than knorm: a repeated token has the same key norm, a tie.)"""
    H = keys.shape[0]
    cached = [list(range(prompt)) for _ in range(H)]
    count = 0
    for k in range(steps):
        for h in range(H):
            cached[h].append(prompt + k)
        count += 1
        if count >= interval:
            count = 0
            for h in range(H):
                if len(cached[h]) > target:
                    idx = torch.tensor(cached[h])
                    best = (-(keys[h, idx] * filters[h]).sum(-1)).topk(target).indices
                    cached[h] = sorted(idx[best].tolist())
    return [set(c) for c in cached]


@pytest.mark.parametrize("interval,target", [(4, 200), (1, 225), (7, 150), (3, 236)])
def test_decoding_keeps_decodingpress_tokens_while_decoding(hf, ids, hub_filters, interval, target):
    """The prompt stays whole; every `interval` decode steps layer 0 keeps kvpress's set (its keys depend on the
    tokens only, so transformers' forward over the same tokens gives them)."""
    from kvbench.runtime.model.families import build_from_transformers
    from kvbench.runtime.serving.engine import Engine

    new = 20
    folder, filters = hub_filters
    method = build_method("decoding", target, base="qfilter", base_options={"path": str(folder)},
                          compression_interval=interval)
    at_end, after_prefill = {}, {}
    inner_end, inner_after = method.on_sequence_end, method.after_attention

    def after_attention(ctx):
        inner_after(ctx)
        if ctx.phase == "prefill" and ctx.last_chunk and ctx.layer == 0:
            after_prefill["n"] = ctx.cache.lengths[0, 0].tolist()

    def on_sequence_end(slot):
        lengths = engine.cache.lengths[slot, 0]
        at_end[0] = [set(engine.cache.positions[slot, 0, h, : int(lengths[h])].tolist())
                     for h in range(lengths.shape[0])]
        inner_end(slot)

    method.on_sequence_end, method.after_attention = on_sequence_end, after_attention
    engine = Engine(build_from_transformers(hf), method, block_size=16, num_blocks=512, prefill_chunk_size=64,
                    attention_backend="torch")
    gen = engine.generate([ids.tolist()], max_new_tokens=new)[0].token_ids
    assert after_prefill["n"] == [T] * len(after_prefill["n"])  # the prompt is not compressed
    fed = torch.tensor(ids.tolist() + list(gen[:-1]))  # the last generated token is never fed back
    with torch.no_grad():
        out = hf(fed[None], use_cache=True)
    keys, _ = layer_kv(out, 0)
    want = decoding_qfilter_reference(keys, filters[0], T, new - 1, target, interval)
    assert at_end[0] == want
    assert all(len(h) < T + new - 1 for h in want)  # the reference compressed


def lukv_reference(out, layer: int, ratio: float, curve: torch.Tensor, filters: torch.Tensor, sink: int,
                   window: int) -> list[set]:
    """kvpress LUKVPress(QFilterPress()).compress: sinks and window at the largest score + 1; the curve's slice
    round(100 r) - 1 gives each head's prune ratio; counts floored, the layer's rounded total reached by the largest
    fractional parts, at least 1; each head keeps its first counts by a stable descending sort."""
    k, _ = layer_kv(out, layer)  # [H, T, D]
    H, n, _ = k.shape
    scores = -(filters[layer][:, None, :] * k).sum(-1)  # QFilterPress.score
    protected = scores.max().item() + 1
    scores[:, :min(sink, n)] = protected
    if window > 0:
        scores[:, max(0, n - window):] = protected
    idx = max(0, min(98, int(round(ratio * 100)) - 1))
    ideal = (1.0 - curve[idx, layer]).clamp(0.0, 1.0) * n
    total = max(H, min(H * n, int(torch.round(ideal.sum()).item())))
    counts = torch.floor(ideal).long()
    rest = total - int(counts.sum())
    if rest > 0:
        counts[torch.topk(ideal - counts, k=min(rest, H)).indices] += 1
    counts = counts.clamp(min=1, max=n)
    order = torch.argsort(scores, dim=-1, descending=True, stable=True)
    return [set(order[h, : int(counts[h])].tolist()) for h in range(H)]


@pytest.fixture(scope="module")
def lukv_curve(hf, tmp_path_factory):
    """A budget curve [99, layers, kv_heads] in LU-KV's .npy format: prune ratios around each target, per head."""
    import numpy as np

    cfg = hf.config
    g = np.random.default_rng(4)
    r = (np.arange(1, 100) / 100)[:, None, None]
    curve = np.clip(r + g.uniform(-0.2, 0.2, (99, cfg.num_hidden_layers, cfg.num_key_value_heads)), 0, 0.99)
    path = tmp_path_factory.mktemp("lukv") / "curve.npy"
    np.save(path, curve.astype(np.float32))
    return path, torch.as_tensor(curve, dtype=torch.float32)


@pytest.mark.parametrize("ratio", [0.5, 0.3, 0.875])
@pytest.mark.parametrize("sink,window", [(4, 1), (0, 7)])
def test_lukv_keeps_lukvpress_tokens_per_head(hf, ids, hf_out, hub_filters, lukv_curve, ratio, sink, window):
    folder, filters = hub_filters
    path, curve = lukv_curve
    method = build_method("lukv", None, compression_ratio=ratio, base="qfilter", base_options={"path": str(folder)},
                          curve_path=str(path), sink=sink, window=window)
    kept, _ = kept_after_prefill(hf, ids, method, 64)
    for layer in range(2):
        want = lukv_reference(hf_out, layer, ratio, curve, filters, sink, window)
        assert kept[layer] == want, f"layer {layer}"
        assert len({len(h) for h in want}) > 1  # the heads keep different counts (the curve's point)


def test_lukv_refuses_a_missing_or_misshapen_curve(hf, tmp_path):
    import numpy as np
    from kvbench.runtime.model.families import build_from_transformers
    from kvbench.runtime.serving.engine import Engine

    np.save(tmp_path / "bad.npy", np.zeros((99, 3, 2), dtype=np.float32))
    for path, match in ((tmp_path / "absent.npy", "no such file"), (tmp_path / "bad.npy", r"needs \(99, 2, 2\)")):
        with pytest.raises(UserError, match=match):
            Engine(build_from_transformers(hf), build_method("lukv", None, compression_ratio=0.5,
                                                             curve_path=str(path)), block_size=16, num_blocks=64)
    with pytest.raises(UserError, match="curve_path"):  # no curve in kvpress's table for this model
        Engine(build_from_transformers(hf), build_method("lukv", None, compression_ratio=0.5), block_size=16,
               num_blocks=64)


def fastkvzip_gate_reference(w: dict, h: torch.Tensor, sink: int) -> torch.Tensor:
    """kvpress FastKVzipGate.forward from its state dict, written out: h [T, E] -> scores [H, T]."""
    d = w["q_norm.weight"].shape[-1]
    H = w["k_proj.weight"].shape[0] // d
    G = w["q_proj.weight"].shape[0] // (H * d)

    def rms(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))

    T = h.shape[0]
    q = rms((h @ w["q_proj.weight"].T + w["q_proj.bias"]).view(T, H, G, d), w["q_norm.weight"])  # [T, H, G, d]
    k = rms((h @ w["k_proj.weight"].T).view(T, H, d), w["k_norm.weight"])  # [T, H, d]
    logit = torch.einsum("thd,thgd->htg", k, q) / d ** 0.5 + w["b"][:, 0][:, None, :]  # [H, T, G]
    base = torch.einsum("hsd,thgd->htsg", w["k_base"][:, 0, :sink], q) / d ** 0.5  # [H, T, S, G]
    return (1 / (1 + torch.exp(base - logit[:, :, None, :]).sum(2))).mean(-1)  # [H, T]


def fastkvzip_reference(hf, out, weights: list, ratio: float, layerwise: bool, n_sink: int = 4,
                        window_ratio: float = 0.02) -> dict:
    """kvpress FastKVzipPress: each layer's gate over its attention input; sinks and the last int(T x 0.02) at 1.0;
    the int(numel x ratio) lowest scores over every layer and head pruned (layerwise: int(H x T x ratio) per
    layer) -> {layer: [kept set per head]}."""
    scores = []
    with torch.no_grad():
        for layer, w in enumerate(weights):
            h = hf.model.layers[layer].input_layernorm(out.hidden_states[layer])[0]  # [T, E]
            s = fastkvzip_gate_reference(w, h, 16)
            s[:, :n_sink] = 1.0
            s[:, -int(s.shape[-1] * window_ratio):] = 1.0
            scores.append(s)
    s = torch.stack(scores)  # [L, H, T]
    L, H, n = s.shape
    pruned = torch.zeros(L * H * n, dtype=torch.bool)
    if layerwise:
        for layer in range(L):
            idx = torch.topk(-s[layer].reshape(-1), int(H * n * ratio)).indices + layer * H * n
            pruned[idx] = True
    else:
        pruned[torch.topk(-s.reshape(-1), int(s.numel() * ratio)).indices] = True
    pruned = pruned.view(L, H, n)
    return {layer: [set((~pruned[layer, h]).nonzero()[:, 0].tolist()) for h in range(H)] for layer in range(L)}


@pytest.fixture(scope="module")
def hub_gates(hf, tmp_path_factory):
    """Random gates for the tiny model in kvpress's file format ({"module": [state dict per layer]})."""
    from kvbench.methods.fastkvzip import FastKVzipGate

    cfg = hf.config
    H, G = cfg.num_key_value_heads, cfg.num_attention_heads // cfg.num_key_value_heads
    torch.manual_seed(11)
    weights = []
    for _ in range(cfg.num_hidden_layers):
        gate = FastKVzipGate(cfg.hidden_size, H, G, 16, 16)
        with torch.no_grad():
            for p in gate.parameters():
                p.normal_(0, 0.3)
        weights.append({k: v.clone() for k, v in gate.state_dict().items()})
    path = tmp_path_factory.mktemp("fastkvzip") / f"q{G}_dim16_sink16.pt"
    torch.save({"module": weights}, path)
    return path, weights


@pytest.mark.parametrize("layerwise", [False, True])
@pytest.mark.parametrize("chunk", [T, 64])
def test_fastkvzip_keeps_fastkvzippress_tokens(hf, ids, hf_out, hub_gates, layerwise, chunk):
    """At ratio 0.5 (where kvpress's int(numel x r) pruned and kvbench's int(T x (1 - r)) per table agree)."""
    path, weights = hub_gates
    method = build_method("fastkvzip", None, compression_ratio=0.5, path=str(path), layerwise=layerwise)
    kept, inner = {}, method.after_prefill_chunk

    def after_prefill_chunk(slot, token_ids, start_pos, last_chunk):  # fastkvzip evicts after the prefill step
        inner(slot, token_ids, start_pos, last_chunk)
        if last_chunk:
            cache = method.engine.cache
            for layer in range(cache.num_layers):
                lengths = cache.lengths[slot, layer]
                kept[layer] = [set(cache.positions[slot, layer, h, : int(lengths[h])].tolist())
                               for h in range(lengths.shape[0])]

    method.after_prefill_chunk = after_prefill_chunk
    kept_after_prefill(hf, ids, method, chunk)
    want = fastkvzip_reference(hf, hf_out, weights, 0.5, layerwise)
    for layer in range(2):
        assert kept[layer] == want[layer], f"layer {layer}"
    if not layerwise:  # the budget across layers: the layers keep different counts
        assert sum(map(len, want[0])) != sum(map(len, want[1]))


def streaming_llm_press_keep(n: int, ratio: float, n_sink: int = 4) -> set:
    """kvpress StreamingLLMPress.compress: scores ones, zeros on [n_sink, n_sink + n_pruned), the top n_kept."""
    n_kept = int(n * (1 - ratio))
    scores = torch.ones(n)
    scores[n_sink: n_sink + n - n_kept] = 0
    return set(scores.topk(n_kept).indices.tolist())


@pytest.mark.parametrize("ratio", [0.25, 0.5, 0.9])
def test_sink_recent_keeps_streamingllmpress_tokens(hf, ids, ratio):
    kept, _ = kept_after_prefill(hf, ids, build_method("sink_recent", None, compression_ratio=ratio), 64)
    for layer in range(2):
        assert kept[layer] == [streaming_llm_press_keep(T, ratio)] * 2


def test_decoding_over_sink_recent_keeps_sinks_and_the_newest(hf, ids):
    """decoding_streaming_llm: DecodingPress(StreamingLLMPress) at target 200 every 4 steps keeps the 4 sinks and
    the newest 196 tokens at each compression (the ratio kvpress derives gives exactly the target)."""
    from kvbench.runtime.model.families import build_from_transformers
    from kvbench.runtime.serving.engine import Engine

    method = build_method("decoding", 200, base="sink_recent", compression_interval=4)
    at_end, inner = {}, method.on_sequence_end

    def on_sequence_end(slot):
        for layer in range(engine.cache.num_layers):
            lengths = engine.cache.lengths[slot, layer]
            at_end[layer] = [set(engine.cache.positions[slot, layer, h, : int(lengths[h])].tolist())
                             for h in range(lengths.shape[0])]
        inner(slot)

    method.on_sequence_end = on_sequence_end
    engine = Engine(build_from_transformers(hf), method, block_size=16, num_blocks=512, prefill_chunk_size=64)
    engine.generate([ids.tolist()], max_new_tokens=19)  # 18 fed tokens: compressions at steps 4, 8, 12, 16
    n = T + 18  # tokens seen; the last compression at step 16 kept 200, then 2 more arrived
    want = set(range(4)) | set(range(T + 16 - 196, T + 16)) | {T + 16, T + 17}
    assert at_end[0] == [want] * 2 and at_end[1] == [want] * 2 and len(want) == 202 and n == T + 18


def test_fastkvzip_keeps_an_uncompressed_question(hf, ids, hub_gates):
    """keep_uncompressed (the query-agnostic protocol's question): the chunk is not evicted and adds to every
    table; the context before it was compressed once."""
    from kvbench.runtime.model.families import build_from_transformers
    from kvbench.runtime.serving.engine import Engine

    path, _ = hub_gates
    budget, ctx, question = 40, ids[:150].tolist(), ids[150:162].tolist()
    method = build_method("fastkvzip", budget, path=str(path), layerwise=True)
    engine = Engine(build_from_transformers(hf), method, block_size=16, num_blocks=256, prefill_chunk_size=64)
    slot = engine.new_sequence()
    engine.forward_chunk(slot, ctx, 0, last_chunk=True, logits_for="none")
    before = engine.cache.lengths[slot].clone()
    assert bool((before.sum(-1) == 2 * budget).all())
    method.keep_uncompressed(slot, len(question))
    engine.forward_chunk(slot, question, len(ctx), last_chunk=True, logits_for="none")
    assert_question_appended_whole(engine, slot, len(ctx), len(question), before)
    engine.end_sequence(slot)
    assert not method._held and not method._state


def test_fastkvzip_hub_file_name_is_kvpresss():
    from kvbench.methods.fastkvzip import gate_file

    assert gate_file("Qwen/Qwen3-8B", 32, 8) == "qwen3-8b/q4_dim16_sink16.pt"
    assert gate_file("meta-llama/Llama-3.1-8B-Instruct", 32, 8) == "llama-3.1-8b-instruct/q4_dim16_sink16.pt"


@pytest.mark.parametrize("name", ["observed_attention", "block_keydiff", "qfilter", "decoding", "lukv", "fastkvzip",
                                  "sink_recent"])
def test_method_yaml_composes_to_the_dataclass_defaults(name):
    from kvbench.run.config import validate
    from tests.harness_fakes import compose

    s = validate(compose([f"method={name}", "budget=256"]))
    assert s.method_name == name
    assert build_method(s.method_name, s.budget, **s.method_options) == METHODS[name](budget=256)

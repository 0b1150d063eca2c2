"""The method variants the parametrized method tests run: every registered method with its defaults, plus the
options that change what it keeps or how it runs (as kvpress's tests/default_presses.py). A new method needs one
line here; tests/methods/test_matrix.py fails while an eviction method is missing from the list.

Each variant is (method name, options for build_method); the options are sized for the tiny test models (budgets
of 32-45 tokens, blocks of 8-16)."""
from __future__ import annotations

import os

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")
KVZAP = os.path.join(FIXTURES, "kvzap_tiny")  # random surrogates in the hub's format for tiny_model's shapes
QFILTER = os.path.join(FIXTURES, "qfilter_tiny")  # random Q-filters in the hub's format for tiny_model's shapes
LUKV_CURVE = os.path.join(FIXTURES, "lukv_tiny", "curve.npy")  # an LU-KV budget curve [99, 2, 2] for tiny_model
FASTKVZIP = os.path.join(FIXTURES, "fastkvzip_tiny", "q2_dim16_sink16.pt")  # random gates, kvpress's format

# (method, options): every registered method with its defaults, plus the main option variants
VARIANTS = [
    ("full", {}),
    ("streaming_llm", {}),
    ("streaming_llm", {"position_mode": "reindex", "sinks": 6}),
    ("h2o", {}),
    ("paged_eviction", {}),
    ("paged_eviction", {"heads": "per_head", "protect_first_block": False}),
    ("kvcrush", {}),
    ("kvcrush", {"importance": "snapkv", "anchor": "mean"}),
    ("snapkv", {}),
    ("snapkv", {"decode": "rescore", "window": 8}),
    ("snapkv", {"decode": "window", "pooling": "maxpool", "kernel_size": 7}),
    ("key_diff", {}),
    ("block_keydiff", {"block_size": 16}),
    ("block_keydiff", {"decode": "evict"}),
    ("random", {"seed": 0}),
    ("knorm", {}),
    ("knorm", {"decode": "evict"}),
    ("rkv", {}),
    ("rkv", {"buffer": 4, "window": 4}),
    ("observed_attention", {}),
    ("observed_attention", {"decode": "evict"}),
    ("tova", {}),
    ("tova", {"decode": "evict", "heads": "per_head"}),
    ("expected_attention", {}),
    ("lagkv", {"lag_size": 8}),
    ("pyramidkv", {"window": 8, "beta": 2}),  # a real pyramid at these budgets (the defaults fall back to SnapKV)
    ("adakv", {"base_options": {"window": 8}}),
    ("adakv", {"base": "h2o"}),
    ("criticalkv", {}),
    ("criticalkv", {"head_adaptive": True, "base_options": {"window": 8}}),
    ("duo_attention", {"patterns_path": os.path.join(FIXTURES, "duo_attention_tiny"), "sinks": 4}),
    ("kvzip", {"chunk_size": 48}),
    ("kvcompose", {}),
    ("kvcompose", {"structured": False, "agg_group": "max", "add_v_norm": True}),
    ("compactor", {"chunk_size": 16}),
    ("adakv_compactor", {"base_options": {"chunk_size": 16}}),
    ("cur", {}),
    ("cur", {"decode": "evict", "leverage_type": "kv_avg", "use_random_leverage": True}),
    ("chunkkv", {"chunk_length": 8, "base_options": {"window": 8}}),
    ("finch", {"window": 8}),
    ("finch", {"window": 8, "rerotate_keys": False, "chunk_length": 24}),
    ("think", {}),
    ("think", {"key_channel_compression_ratio": 0.5, "window_size": 8}),
    ("think", {"key_channel_compression_ratio": 0.25, "base": "knorm", "decode": "evict"}),
    ("merge", {}),
    ("merge", {"base": "snapkv", "base_options": {"window": 8}, "decode": "cam", "compression_interval": 1,
               "merge_budget": 4}),
    ("merge", {"base": "tova", "decode": "cam", "compression_interval": 1, "compress_prompt": False}),  # CAMPress
    ("fastkvzip", {"path": FASTKVZIP}),
    ("fastkvzip", {"path": FASTKVZIP, "layerwise": True, "window_ratio": 0.1}),
    ("lukv", {"curve_path": LUKV_CURVE}),
    ("lukv", {"base": "qfilter", "base_options": {"path": QFILTER}, "curve_path": LUKV_CURVE, "sink": 0,
              "window": 3}),
    ("qfilter", {"path": QFILTER}),
    ("qfilter", {"decode": "evict", "path": QFILTER}),
    ("sink_recent", {}),
    ("sink_recent", {"n_sink": 2, "decode": "evict"}),
    ("decoding", {"base": "sink_recent", "compression_interval": 4}),
    ("decoding", {"compression_interval": 4}),
    ("decoding", {"base": "snapkv", "base_options": {"window": 8}, "head_adaptive": True, "compression_interval": 3}),
    ("kvzap", {"path": os.path.join(KVZAP, "mlp")}),
    ("kvzap", {"surrogate": "linear", "path": os.path.join(KVZAP, "linear"), "decode": "evict"}),
    ("dms", {"base_options": {"path": os.path.join(KVZAP, "mlp")}, "threshold": 0.0, "sliding_window_size": 8}),
    ("dms", {"base": "knorm", "threshold": -6.0, "sliding_window_size": 8, "decode": "evict"}),
    ("quest", {"dense_layers": 0}),  # retrieval, not eviction: every layer of the tiny models retrieves
]


def knobs(name: str, budget=None, compression_ratio=None) -> dict:
    """The budget knobs to build method `name` with: none for a threshold rule (dms), which refuses them."""
    from kvbench.methods import METHODS

    if not getattr(METHODS[name], "needs_budget", True):
        return {"budget": None}
    return {"budget": budget} if compression_ratio is None else {"budget": None, "compression_ratio": compression_ratio}


def budgeted(variants):
    """The variants a budget bounds (the budget-centric tests' matrix): all but threshold rules."""
    from kvbench.methods import METHODS

    return [v for v in variants if getattr(METHODS[v[0]], "needs_budget", True)]


def variant_id(variant) -> str:
    """The test id of a variant: the method name, then -option=value for each option."""
    name, opts = variant
    return name + "".join(f"-{k}={x}" for k, x in opts.items())


def rotated(variants, combos, names):
    """pytest params for `variants` x `combos` (tuples of the other axes' values, named by `names`): in the default
    suite each variant runs one combination, the i-th variant the (i mod len(combos))-th, so every combination
    still runs across the variants; the rest are marked slow (`make test-all` runs every pair)."""
    import pytest

    params = []
    for i, variant in enumerate(variants):
        for j, combo in enumerate(combos):
            marks = [] if j == i % len(combos) else [pytest.mark.slow]
            label = "-".join(f"{n}={x}" for n, x in zip(names, combo))
            params.append(pytest.param(variant, *combo, marks=marks, id=f"{variant_id(variant)}-{label}"))
    return params

"""Methods change the cache only through its named operations: every member of the cache that methods/*.py reads or
calls is in kvbench.runtime.cache.kv_eviction.METHOD_SURFACE (the MethodCacheView protocol), and every name there is
real on both caches."""
from __future__ import annotations

import ast
import pathlib

import pytest
import torch

from kvbench.quant.codecs import KiviCodec
from kvbench.runtime.cache.caches import build_cache
from kvbench.runtime.cache.kv_eviction import METHOD_SURFACE

METHODS_DIR = pathlib.Path(__file__).resolve().parents[2] / "methods"


def cache_members_used(source: str) -> dict[str, int]:
    """{member: first line} of every attribute a module reads or calls on a cache: `<x>.cache.<member>`,
    `<name>.<member>` where the name is `cache` (a parameter) or was assigned `<x>.cache`, and getattr(<those>, "m")."""
    tree = ast.parse(source)
    aliases = {"cache"}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                pairs = (zip(target.elts, node.value.elts)
                         if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple)
                         else [(target, node.value)])
                for t, v in pairs:
                    if isinstance(t, ast.Name) and isinstance(v, ast.Attribute) and v.attr == "cache":
                        aliases.add(t.id)

    def is_cache(node: ast.AST) -> bool:
        return ((isinstance(node, ast.Name) and node.id in aliases)
                or (isinstance(node, ast.Attribute) and node.attr == "cache"))

    used: dict[str, int] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_cache(node.value):
            used.setdefault(node.attr, node.lineno)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "setattr")
              and node.args and is_cache(node.args[0])):
            name = node.args[1].value if len(node.args) > 1 and isinstance(node.args[1], ast.Constant) else "<dynamic>"
            used.setdefault(str(name), node.lineno)
    return used


def test_methods_touch_the_cache_only_through_its_method_surface():
    files = sorted(METHODS_DIR.glob("*.py"))
    assert len(files) > 10
    outside = {f"{p.name}:{line} cache.{name}" for p in files
               for name, line in cache_members_used(p.read_text(encoding="utf-8")).items()
               if name not in METHOD_SURFACE}
    assert not outside, f"methods use cache members outside kv_eviction.MethodCacheView: {sorted(outside)}"


@pytest.mark.parametrize("source,name", [
    ("def after_attention(self, ctx):\n    ctx.cache.pool.free([3])\n", "pool"),
    ("def f(self):\n    self.cache.k_pool[0] = 0\n", "k_pool"),
    ("def f(ctx):\n    c, layer = ctx.cache, ctx.layer\n    c.truncate(0, 4)\n", "truncate"),
    ("def attach(self, cache, cfg):\n    getattr(cache, 'plain_pools')\n", "plain_pools"),
])
def test_the_scan_finds_a_call_outside_the_surface(source, name):
    used = cache_members_used(source)
    assert name in used and name not in METHOD_SURFACE


@pytest.mark.parametrize("codec", [None, KiviCodec(bits=2, group_size=16, residual=16)], ids=["full", "kivi"])
def test_every_name_of_the_surface_is_a_member_of_the_cache(codec):
    cache = build_cache(codec=codec, kv_memory_bytes=1 << 16, num_layers=2, num_kv_heads=2, head_dim=16,
                        block_size=16, dtype=torch.float32, device="cpu")
    assert {"keep_tokens", "evict_blocks", "evict_blocks_on_device", "drop_slots", "gather"} <= METHOD_SURFACE
    missing = [name for name in METHOD_SURFACE if not hasattr(cache, name)]
    assert not missing

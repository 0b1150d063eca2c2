"""The cache room: where KV bytes live and who owns which block.

    block_pool        ids, reference counts and a free list (no tensors)
    kv_geometry       block sizes and bytes, the scratch block
    append_plan       where one step's new tokens go (AppendPlan)
    kv_layout         the full-precision K/V pools and the operations that depend on their layout
    kv_cache          PagedKVCache: block tables per sequence, layer and kv-head
    kv_eviction       the named operations a method may call (keep tokens, evict blocks, drop slots)
    kv_accounting     bytes and blocks in use, measured from the pool; kv_meter: the run's KV figures
    quantized_*       a storage codec's cache: packed pools, routing, reading
    prefix_cache      shared prompt blocks; swap: host memory for swapped-out sequences
    caches            build_cache: the one place a cache class is chosen

The cache imports neither the model nor the serving loop (pyproject.toml's import-linter contract).
"""

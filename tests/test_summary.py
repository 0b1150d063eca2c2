"""The run summary's KV memory lines: % saved counts only what eviction or a codec removed, measured from the pool
(forks' shared blocks and pool use are shown apart, named), on a tiny model through the real engine."""
from __future__ import annotations

import pytest
import torch

from kvbench.runtime.engine import Engine
from kvbench.runtime.scheduler import Request
from kvbench.summary import format_summary, saved_fraction
from kvbench.methods import build_method
from tests.tiny_models import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def _record(engine: Engine, method: str, **extra) -> dict:
    mem = engine.memory_stats()
    return {"run_id": "r", "status": "ok", "method": method, "budget": None, "task": "t",
            **{k: mem[k] for k in ("peak_kv_bytes", "full_kv_bytes", "held_kv_bytes", "fork_shared_kv_bytes",
                                   "kv_pool_bytes", "kv_bytes_per_token")}, **extra}


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 300, (n,), generator=g).tolist()


def test_forked_continuations_under_full_save_nothing_and_show_the_sharing(model):
    engine = Engine(model, build_method("full"), block_size=4, num_blocks=400)
    engine.score_continuations(_ids(40, 0), [_ids(3, 1), _ids(3, 2), _ids(3, 3)])
    mem = engine.memory_stats()
    assert mem["fork_shared_kv_bytes"] > 0  # the forks shared the context's blocks
    assert mem["peak_kv_bytes"] < mem["full_kv_bytes"]  # which is why the old figure said "40% saved"
    assert mem["held_kv_bytes"] == mem["full_kv_bytes"]
    rec = _record(engine, "full")
    assert saved_fraction(rec) == 0.0
    text = format_summary(rec)
    assert "KV saved  0.0%: nothing removed" in text
    assert "KV shared" in text and "by forks" in text and "not counted as saved" in text


def test_eviction_saving_is_measured_and_forks_do_not_inflate_it(model):
    ctx, conts = _ids(60, 4), [_ids(3, 5), _ids(3, 6)]
    full = Engine(model, build_method("full"), block_size=4, num_blocks=400)
    full.score_continuations(ctx, conts)
    h2o = Engine(model, build_method("h2o", 16), block_size=4, num_blocks=400)
    h2o.score_continuations(ctx, conts)
    mem = h2o.memory_stats()
    assert mem["full_kv_bytes"] == full.memory_stats()["full_kv_bytes"]
    saved = saved_fraction(_record(h2o, "h2o"))
    # h2o kept ~16 + the continuation of ~63 tokens per sequence: well over half removed, never all
    assert 0.5 < saved < 0.9
    assert saved == pytest.approx(1 - mem["held_kv_bytes"] / mem["full_kv_bytes"])
    assert f"KV saved  {100 * saved:.1f}% by eviction" in format_summary(_record(h2o, "h2o"))


def test_throughput_runs_that_fill_the_same_pool_say_so(model):
    """full and paged_eviction serving the same trace into a small pool: both show the pool full; only eviction
    shows a saving."""
    def serve(method):
        engine = Engine(model, method, block_size=4, num_blocks=80, max_num_seqs=8)
        reqs = [Request(prompt=_ids(24, 10 + i), max_new_tokens=24, ignore_eos=True, index=i) for i in range(8)]
        engine.serve(reqs)
        return engine

    full, evict = serve(build_method("full")), serve(build_method("paged_eviction", 16))
    rf, re_ = _record(full, "full"), _record(evict, "paged_eviction")
    for rec in (rf, re_):
        assert rec["peak_kv_bytes"] > 0.8 * rec["kv_pool_bytes"]
        assert "KV pool   peak" in format_summary(rec) and "% used" in format_summary(rec)
    assert saved_fraction(rf) == 0.0 and saved_fraction(re_) > 0.2


def test_records_without_the_measurement_print_no_percentage():
    old = {"run_id": "r", "status": "ok", "method": "full", "peak_kv_bytes": 600, "full_kv_bytes": 1000}
    text = format_summary(old)
    assert "saved" in text and "%" not in text.split("KV saved")[1].splitlines()[0]
    assert saved_fraction(old) is None

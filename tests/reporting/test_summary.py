"""The run summary's KV memory lines: % saved counts only what eviction or a codec removed, measured from the pool
(forks' shared blocks and pool use are shown apart, named), on a tiny model through the real engine."""
from __future__ import annotations

import pytest
import torch

from kvbench.methods import build_method
from kvbench.runtime.serving.engine import Engine
from kvbench.runtime.serving.requests import Request
from kvbench.runtime.serving.scoring import Scorer
from kvbench.reporting.summary import format_summary, format_sweep_table, next_step_lines, peak_saved_fraction, saved_fraction
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
    Scorer(engine).score_continuations(_ids(40, 0), [_ids(3, 1), _ids(3, 2), _ids(3, 3)])
    mem = engine.memory_stats()
    assert mem["fork_shared_kv_bytes"] > 0  # the forks shared the context's blocks
    assert mem["peak_kv_bytes"] < mem["full_kv_bytes"]  # which is why the old figure said "40% saved"
    assert mem["held_kv_bytes"] == mem["full_kv_bytes"]
    rec = _record(engine, "full")
    assert saved_fraction(rec) == 0.0
    text = format_summary(rec)
    assert "0.0% saved, nothing removed" in text and text.count("KV held") == 1
    assert "KV shared" in text and "by forks" in text and "not counted as saved" in text
    # the pool's peak is below the uncompressed figure only because forks shared blocks: no peak saving claimed
    assert peak_saved_fraction(rec) is None and "no saving at the peak is given: forks shared blocks" in text


def test_eviction_saving_is_measured_and_forks_do_not_inflate_it(model):
    ctx, conts = _ids(60, 4), [_ids(3, 5), _ids(3, 6)]
    full = Engine(model, build_method("full"), block_size=4, num_blocks=400)
    Scorer(full).score_continuations(ctx, conts)
    h2o = Engine(model, build_method("h2o", 16), block_size=4, num_blocks=400)
    Scorer(h2o).score_continuations(ctx, conts)
    mem = h2o.memory_stats()
    assert mem["full_kv_bytes"] == full.memory_stats()["full_kv_bytes"]
    saved = saved_fraction(_record(h2o, "h2o"))
    # h2o kept ~16 + the continuation of ~63 tokens per sequence: well over half removed, never all
    assert 0.5 < saved < 0.9
    assert saved == pytest.approx(1 - mem["held_kv_bytes"] / mem["full_kv_bytes"])
    assert f"{100 * saved:.1f}% saved by eviction" in format_summary(_record(h2o, "h2o"))


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
    assert "not measured" in text and "%" not in text.split("KV held")[1].splitlines()[0]
    assert saved_fraction(old) is None


def test_the_summary_leads_with_the_peak_saving_and_names_the_held_one(model):
    """A method that compresses the prompt once (snapkv) holds far less after compression than at its peak, which
    came before it: the summary leads with the peak saving (what to provision), the held saving named as such;
    the sweep table shows both."""
    prompt = _ids(96, 7)
    snap = Engine(model, build_method("snapkv", compression_ratio=0.5, window=8), block_size=4, num_blocks=400)
    snap.generate([prompt], max_new_tokens=4)
    rec = _record(snap, "snapkv")
    peak, held = peak_saved_fraction(rec), saved_fraction(rec)
    assert peak == pytest.approx(1 - rec["peak_kv_bytes"] / rec["full_kv_bytes"])
    assert peak < held  # the peak came before the prompt was compressed
    lines = format_summary(rec).splitlines()
    kv = [i for i, line in enumerate(lines) if line.startswith(("KV peak", "KV held"))]
    assert lines[kv[0]].startswith("KV peak") and f"{100 * peak:.1f}% saved at the peak" in lines[kv[0]]
    assert lines[kv[1]].startswith("KV held") and f"{100 * held:.1f}% saved by eviction" in lines[kv[1]]
    table = format_sweep_table([rec, _record(snap, "full")])
    assert "peak saved" in table and "held saved" in table and f"{100 * peak:.1f}%" in table


@pytest.mark.parametrize("task,hint", [("perplexity", "raise task.max_tokens"), ("ruler", "raise task.lengths"),
                                       ("lm_eval", "lower budget: this task's prompts are its own")])
def test_budget_never_reached_names_an_option_the_task_has(task, hint):
    rec = {"run_id": "r", "status": "ok", "method": "h2o", "budget": 512, "task": task, "budget_reached": False,
           "max_sequence_tokens": 300}
    text = " ".join(format_summary(rec).split())
    assert hint in text and (task == "perplexity" or "task.max_tokens" not in text)


def test_the_serving_summary_names_the_decode_and_the_end_to_end_rate():
    rec = {"run_id": "r", "status": "ok", "method": "full", "task": "throughput", "decode_tokens_per_s": 40.0,
           "output_tokens_per_s": 25.0, "prefill_tokens_per_s": 300.0}
    text = format_summary(rec)
    assert "decode 40 tok/s" in text and "end-to-end output 25 tok/s" in text and "prefill included" in text
    assert "output_tokens_per_s 25" not in text  # shown once, under its name


NEXT = "next      add method=paged_eviction budget="


@pytest.mark.parametrize("record, budget", [
    ({"method": "full", "max_sequence_tokens": 4096}, 1024),  # the default run: 4,096 tokens of essays
    ({"method": None, "storage_codec": "none", "max_sequence_tokens": 1500}, 1024),
    ({"method": "full", "max_sequence_tokens": 300}, 144),  # a short task: half its longest sequence, whole blocks
    ({"method": "full", "max_sequence_tokens": 20}, 16),
    ({"method": "full"}, 1024),  # a record without the figure
])
def test_an_uncompressed_run_ends_with_the_overrides_that_compress_it(record, budget):
    rec = {"run_id": "r", "status": "ok", "task": "perplexity", **record}
    text = format_summary(rec, "/tmp/r", next_step=True)
    assert f"{NEXT}{budget} to this command" in text, text
    assert text.rstrip().endswith("=" * 10)  # inside the box, as its last line
    assert NEXT not in format_summary(rec, "/tmp/r")  # not asked for (a sweep's runs, a stored summary)


@pytest.mark.parametrize("record", [
    {"method": "paged_eviction", "budget": 1024},  # compressed already: by eviction,
    {"method": "full", "storage_codec": "kivi"},  # by a codec,
    {"method": "full", "status": "failed", "error": "boom"},  # or the run failed
])
def test_no_next_step_after_a_compressed_or_failed_run(record):
    rec = {"run_id": "r", "status": "ok", "task": "perplexity", "max_sequence_tokens": 4096, **record}
    assert next_step_lines(rec) == []
    assert NEXT not in format_summary(rec, "/tmp/r", next_step=True)


def test_the_summary_shows_what_decode_read_beside_what_was_resident():
    rec = {"run_id": "r", "status": "ok", "method": "quest", "budget": 512, "peak_kv_bytes": 1060 * 2**20,
           "full_kv_bytes": 1000 * 2**20, "held_kv_bytes": 1000 * 2**20, "kv_read_bytes_per_token": 25 * 2**20,
           "kv_read_fraction": 0.25, "summary_read_bytes_per_token": 6 * 2**20}
    line = " ".join(format_summary(rec).split("KV read")[1].split())
    assert line.startswith("25.0 MiB per decoded token + 6.0 MiB of page summaries: 25.0% of what full attention")
    assert "KV read" not in format_summary({k: v for k, v in rec.items() if not k.startswith(("kv_read", "summ"))})
    table = format_sweep_table([rec, dict(rec, budget=1024, kv_read_fraction=0.5)])
    assert "kv_read_fraction" in table.splitlines()[1]


def _sweep_rows(table: str) -> tuple[list[str], list[list[str]]]:
    lines = table.splitlines()
    return lines[1].split(), [line.split() for line in lines[3:-1] if not line.startswith("(")]


def test_sweep_table_leads_with_the_headline_score_and_sorts_numbers_as_numbers():
    # issue 67 item 4: a RULER budget sweep showed its first subtasks' scores, not `score`, and sorted budgets as
    # text (1024, 112, ..., 96)
    parts = {f"score_task{i}": 10.0 * i for i in range(8)}
    records = [{"run_id": f"r{b}", "status": "ok", "method": "snapkv", "budget": b, "task": "ruler", **parts,
                "score": 50.0 + b / 100, "score_tasks": "a,b"} for b in (1024, 112, 96, 256)]
    header, rows = _sweep_rows(format_sweep_table(records))
    assert header[:3] == ["method", "budget", "score"]
    assert [row[1] for row in rows] == ["96", "112", "256", "1,024"]
    assert [row[2] for row in rows] == ["50.96", "51.12", "52.56", "60.24"]


def test_sweep_table_shows_the_swept_ratio_and_threshold():
    ratio = [{"run_id": f"r{x}", "status": "ok", "method": "snapkv", "budget": None, "compression_ratio": x,
              "task": "ruler", "score": 90 - 100 * x} for x in (0.75, 0.1, 0.5, 0.25)]
    header, rows = _sweep_rows(format_sweep_table(ratio))
    assert header[:4] == ["method", "budget", "ratio", "score"]
    assert [row[2] for row in rows] == ["0.1", "0.25", "0.5", "0.75"]
    thresholds = [{"run_id": f"t{t}", "status": "ok", "method": "dms", "budget": None, "method_threshold": t,
                   "task": "perplexity", "ppl": 10.0 - t, "kv_kept_fraction": 0.5} for t in (-10, -3, -5)]
    header, rows = _sweep_rows(format_sweep_table(thresholds))
    assert header[:4] == ["method", "budget", "threshold", "ppl"]
    assert [row[2] for row in rows] == ["-10", "-5", "-3"]


def test_the_summary_leads_with_its_metrics_and_ends_with_its_provenance():
    record = {"run_id": "smollm2_ppl_h2o_b64", "status": "ok", "model": "smollm2-135m", "dtype": "float32",
              "device": "cpu", "method": "h2o", "budget": 64, "task": "perplexity", "num_samples": 1, "ppl": 12.5,
              "nll": 2.53, "prefill_tokens_per_s": 900.0, "decode_tokens_per_s": None, "ttft_s": 0.2,
              "peak_kv_bytes": 1000, "full_kv_bytes": 4000, "held_kv_bytes": 1000, "kv_bytes_per_token": 10,
              "wall_s": 3.0, "pid": 7, "seed": 0, "git_commit": "abc", "wandb_group": "sweep-results-1234abcd"}
    lines = format_summary(record, "results/smollm2_ppl_h2o_b64").splitlines()
    assert "kvbench run OK" in lines[0]
    assert lines[1].startswith("ppl 12.5") and "nll" in lines[1]  # the metrics, right under the title
    at = {key: next(i for i, line in enumerate(lines) if line.startswith(key))
          for key in ("speed", "run ", "model ", "method ", "task ", "time ", "results ")}
    assert at["speed"] < at["run "] < at["model "] < at["method "] < at["task "] < at["time "] < at["results "]
    assert not any("wandb_group" in line or "sweep-results" in line for line in lines)  # a constant, not a metric
    failed = format_summary({**record, "status": "failed", "error": "RuntimeError: boom"}).splitlines()
    assert failed[1] == "error     RuntimeError: boom"

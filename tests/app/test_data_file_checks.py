"""A local task.data_path file that cannot be used (empty, malformed jsonl, without the task's columns) is refused
before the model loads: one line naming the file and what is wrong, exit 2, no run folder, no runs.jsonl line; in a
sweep, before the first job. The packaged `kvbench:smoke` problems are in each set's own format."""
from __future__ import annotations

import json

import pytest

from kvbench.data import reasoning as rd
from kvbench.data.local_rows import check_rows
from kvbench.errors import UserError
from tests.app.test_bad_input import cli  # noqa: F401  (the in-process CLI fixture)
from tests.app.test_cli import assert_usage_error, kvbench

GSM8K_ROW = {"question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"}


def _write(path, text):
    path.write_text(text)
    return str(path)


BAD_FILES = [  # (file name, content, the words the refusal must hold)
    ("empty.jsonl", "", ("empty.jsonl", "is empty", "question, answer")),
    ("blank.jsonl", "\n  \n", ("blank.jsonl", "only whitespace")),
    ("torn.jsonl", json.dumps(GSM8K_ROW) + "\n{\"question\": \"x\", \n", ("torn.jsonl", "line 2", "not JSON")),
    ("cols.jsonl", json.dumps({"problem": "x", "solution": "y"}) + "\n",
     ("cols.jsonl", "line 1", "'question', 'answer'", "expected question, answer", "it has problem, solution")),
    ("list.jsonl", "[1, 2]\n", ("list.jsonl", "line 1", "not an object")),
]


@pytest.mark.parametrize("name,text,needles", BAD_FILES, ids=[b[0] for b in BAD_FILES])
def test_check_rows_names_the_file_and_the_fault(tmp_path, name, text, needles):
    path = _write(tmp_path / name, text)
    with pytest.raises(UserError) as info:
        check_rows(path, ("question", "answer"))
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"task.data_path file {path}")
    for needle in needles:
        assert needle in message, (needle, message)


def test_check_rows_accepts_good_files_of_each_format(tmp_path):
    cols = ("question", "answer")
    check_rows(_write(tmp_path / "a.jsonl", json.dumps(GSM8K_ROW) + "\n\n" + json.dumps(GSM8K_ROW) + "\n"), cols)
    check_rows(_write(tmp_path / "a.json", json.dumps([GSM8K_ROW, GSM8K_ROW])), cols)
    check_rows(_write(tmp_path / "b.json", json.dumps(GSM8K_ROW) + "\n"), cols)  # JSON lines in a .json file
    check_rows(_write(tmp_path / "a.csv", "question,answer\nq,a\n"), cols)
    check_rows(rd.GSM8K_SMOKE_FILE, cols)
    check_rows(rd.SMOKE_FILE, ("problem", "answer"))


def test_check_rows_refuses_bad_json_csv_and_parquet(tmp_path):
    cols = ("question", "answer")
    for path, needle in ((_write(tmp_path / "a.json", "[]"), "empty JSON array"),
                         (_write(tmp_path / "b.json", "[{\"question\": 1,}]"), "not JSON"),
                         (_write(tmp_path / "c.csv", "question\nq\n"), "no 'answer' column"),
                         (_write(tmp_path / "d.csv", "question,answer\n"), "no rows"),
                         (_write(tmp_path / "e.parquet", "not parquet"), "cannot be read as parquet")):
        with pytest.raises(UserError, match=needle):
            check_rows(path, cols)


def test_a_parquet_file_without_the_columns_names_them(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = str(tmp_path / "test.parquet")
    pq.write_table(pa.table({"question": ["q"]}), path)
    with pytest.raises(UserError, match="no 'answer' column .expected question, answer; it has question"):
        check_rows(path, ("question", "answer"))


def test_smoke_data_is_in_each_sets_format():
    gsm = rd.load_reasoning("gsm8k", rd.SMOKE_DATA)
    assert len(gsm) == 3 and all(rd.gsm8k_gold(r["answer"]) for r in gsm)
    assert [rd.gsm8k_gold(r["answer"]) for r in gsm] == ["26", "32", "120"]
    assert len(rd.load_reasoning("math500", rd.SMOKE_DATA)) == 3


def _assert_nothing_written(results):
    assert not results.exists() or not any(results.iterdir()), list(results.iterdir())


@pytest.mark.parametrize("task,name", [("gsm8k", "empty.jsonl"), ("gsm8k", "torn.jsonl"), ("gsm8k", "cols.jsonl"),
                                       ("longbench_v2", "empty.jsonl"), ("longbench_v2", "cols.jsonl")])
def test_a_bad_data_file_is_refused_before_the_model_loads(cli, monkeypatch, tmp_path, task, name):  # noqa: F811
    """The real CLI entry (Hydra included) in this process, the model loader replaced by a failure."""
    import kvbench.run.app as app

    def no_loading(*a, **k):
        raise AssertionError("the model was loaded for a bad data file")

    monkeypatch.setattr(app, "_load_model", no_loading)
    ((text, needles),) = [b[1:] for b in BAD_FILES if b[0] == name]
    path = _write(tmp_path / name, text)
    results = tmp_path / "r"
    code, out, err = cli([f"task={task}", f"task.data_path={path}", "logger.wandb=false", f"results_dir={results}"])
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("kvbench: error: "), (code, out, err)
    for needle in (path, *(n for n in needles if task == "gsm8k" or "question" not in n)):
        assert needle in lines[0], (needle, lines[0])
    assert "Traceback" not in out + err and "loading" not in out.lower()
    _assert_nothing_written(results)


def test_a_bad_data_file_is_refused_as_a_real_subprocess(tmp_path):
    path = _write(tmp_path / "cols.jsonl", BAD_FILES[3][1])
    results = tmp_path / "r"
    proc = kvbench("task=gsm8k", f"task.data_path={path}", f"results_dir={results}", cwd=tmp_path)
    assert_usage_error(proc, path, "expected question, answer")
    assert "loading" not in proc.stdout.lower()
    _assert_nothing_written(results)


def test_a_sweep_over_a_bad_data_file_is_refused_before_its_first_job(tmp_path):
    path = _write(tmp_path / "torn.jsonl", BAD_FILES[2][1])
    results = tmp_path / "r"
    proc = kvbench("-m", "task=gsm8k", f"task.data_path={path}", "budget=8,16", f"results_dir={results}",
                   cwd=tmp_path)
    assert_usage_error(proc, path, "line 2")
    _assert_nothing_written(results)


def test_the_documented_gsm8k_smoke_command_runs(cli, tmp_path):  # noqa: F811
    """`task=gsm8k task.data_path=kvbench:smoke` (conf/task/gsm8k.yaml) with the smallest limits, end to end on the
    packaged model (the real CLI entry, in this process)."""
    results = tmp_path / "r"
    code, out, err = cli(["task=gsm8k", "task.data_path=kvbench:smoke", "task.limit=1", "task.max_new_tokens=4",
                          "task.greedy=true", "logger.wandb=false", f"results_dir={results}"])
    assert code == 0, err[-3000:]
    (run_dir,) = [p for p in results.iterdir() if p.is_dir()]
    record = json.loads((run_dir / "metrics.json").read_text())
    assert record["status"] == "ok", record
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 1 and samples[0]["id"].startswith("gsm8k-")

"""LongBench dataset list, prompts, truncation and loaders (local jsonl / zip fixtures; no network)."""

import json
import sys
import types
import zipfile

import pytest

from kvbench.data import govreport
from kvbench.data import longbench as lb


def _record(i, dataset="hotpotqa", answers=("Paris",)):
    return {
        "input": f"question {i}?",
        "context": f"context {i}",
        "answers": list(answers),
        "length": 1000 * i,
        "dataset": dataset,
        "language": "en",
        "all_classes": None,
        "_id": f"id{i}",
    }


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


# --------------------------------------------------------------------------- tables
def test_dataset_lists():
    assert len(lb.LONGBENCH_DATASETS) == 21
    assert set(lb.LONGBENCH_EN) | set(lb.LONGBENCH_ZH) == set(lb.LONGBENCH_DATASETS)
    assert len(lb.LONGBENCH_E_DATASETS) == 13 and "qasper_e" in lb.LONGBENCH_E_DATASETS
    assert "narrativeqa_e" not in lb.ALL_DATASETS
    assert lb.language("lsht") == "zh" and lb.language("qasper_e") == "en"


def test_max_new_tokens_follow_the_official_table():
    expected = {128: ["narrativeqa", "qasper", "dureader", "samsum"],
                64: ["multifieldqa_en", "multifieldqa_zh", "trec", "lsht", "lcc", "repobench-p"],
                32: ["hotpotqa", "2wikimqa", "musique", "triviaqa", "passage_count", "passage_retrieval_en",
                     "passage_retrieval_zh"],
                512: ["gov_report", "qmsum", "multi_news", "vcsum"]}  # fmt: skip
    got = {n: sorted(d for d, m in lb.DATASET2MAXLEN.items() if m == n) for n in expected}
    assert got == {n: sorted(v) for n, v in expected.items()}
    assert lb.max_new_tokens("gov_report_e") == 512


def test_chat_template_exceptions():
    assert lb.NO_CHAT_TEMPLATE == {"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"}
    assert not lb.uses_chat_template("samsum_e")
    assert lb.uses_chat_template("qasper")


def test_prompt_templates():
    assert set(lb.DATASET2PROMPT) == set(lb.LONGBENCH_DATASETS)
    for name, tpl in lb.DATASET2PROMPT.items():
        assert "{context}" in tpl, name
    no_input = {n for n, t in lb.DATASET2PROMPT.items() if "{input}" not in t}
    assert no_input == {"gov_report", "multi_news", "vcsum", "passage_count", "lcc"}
    assert lb.DATASET2PROMPT["lcc"] == "Please complete the code given below. \n{context}Next line of code:\n"
    assert lb.DATASET2PROMPT["trec"] == (
        "Please determine the type of the question below. Here are some examples of questions.\n\n{context}\n{input}"
    )
    tail = '答案格式必须是"段落1"，"段落2"等格式\n\n答案是：'
    assert lb.DATASET2PROMPT["passage_retrieval_zh"].endswith(tail)
    prompt = lb.build_prompt("repobench-p", {"context": "def f():{x}\n", "input": "    return"})
    assert prompt == "Please complete the code given below. \ndef f():{x}\n    returnNext line of code:\n"


# --------------------------------------------------------------------------- truncation
def test_truncate_middle_keeps_both_halves():
    ids = list(range(10))
    assert lb.truncate_middle(ids, 4) == [0, 1, 8, 9]
    assert lb.truncate_middle(ids, 5) == [0, 1, 8, 9]  # int(5 / 2) = 2 per side, as pred.py
    assert lb.truncate_middle(ids, 10) == ids
    assert lb.truncate_middle(tuple(ids), 20) == ids
    with pytest.raises(ValueError):
        lb.truncate_middle(ids, 1)


def test_truncate_middle_tensor():
    torch = pytest.importorskip("torch")
    out = lb.truncate_middle(torch.arange(10), 6)
    assert out.tolist() == [0, 1, 2, 7, 8, 9]


class WordTokenizer:
    """Whitespace tokenizer with a BOS special token (id 0), like a HF tokenizer's encode/decode."""

    def __init__(self):
        self.vocab, self.words = {"<s>": 0}, ["<s>"]

    def encode(self, text, add_special_tokens=True):
        ids = [0] if add_special_tokens else []
        for w in text.split():
            if w not in self.vocab:
                self.vocab[w] = len(self.words)
                self.words.append(w)
            ids.append(self.vocab[w])
        return ids

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(self.words[i] for i in ids if not (skip_special_tokens and i == 0))


def test_truncate_prompt_middle_decodes_halves_without_special_tokens():
    tok = WordTokenizer()
    text = "one two three four five six seven"
    # encode -> [<s>, one, ..., seven] (8 ids); max 4 -> [<s>, one] + [six, seven]; BOS skipped on decode
    assert lb.truncate_prompt_middle(tok, text, 4) == "one" + "six seven"
    assert lb.truncate_prompt_middle(tok, text, 100) == text


# --------------------------------------------------------------------------- loaders
def test_load_local_jsonl(tmp_path):
    _write_jsonl(tmp_path / "hotpotqa.jsonl", [_record(i) for i in range(3)])
    rows = lb.load_longbench("hotpotqa", data_dir=tmp_path)
    assert [r["_id"] for r in rows] == ["id0", "id1", "id2"]
    assert rows[1]["answers"] == ["Paris"] and rows[1]["length"] == 1000
    assert set(lb.RECORD_FIELDS) <= set(rows[0])
    assert len(lb.load_longbench("hotpotqa", data_dir=str(tmp_path), limit=2)) == 2
    assert lb.load_longbench("hotpotqa", data_dir=tmp_path, limit=0) == []


def test_load_fills_missing_optional_fields(tmp_path):
    (tmp_path / "lsht.jsonl").write_text(json.dumps({"context": "c", "answers": "体育"}) + "\n\n", encoding="utf-8")
    (row,) = lb.load_longbench("lsht", data_dir=tmp_path)
    assert row["answers"] == ["体育"]
    assert row["language"] == "zh" and row["dataset"] == "lsht" and row["input"] == "" and row["all_classes"] is None


def test_load_e_subset_reads_its_own_file(tmp_path):
    _write_jsonl(tmp_path / "qasper_e.jsonl", [_record(7, dataset="qasper")])
    _write_jsonl(tmp_path / "qasper.jsonl", [_record(1, dataset="qasper")])
    assert lb.load_longbench("qasper_e", data_dir=tmp_path)[0]["_id"] == "id7"


def test_missing_file_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="musique.jsonl"):
        lb.load_longbench("musique", data_dir=tmp_path)


def test_unknown_dataset_names_valid_choices(tmp_path):
    with pytest.raises(ValueError, match="hotpot_qa") as err:
        lb.load_longbench("hotpot_qa", data_dir=tmp_path)
    assert "hotpotqa" in str(err.value) and "qasper_e" in str(err.value)
    with pytest.raises(ValueError):
        lb.load_longbench("hotpotqa", data_dir=tmp_path, limit=-1)


def test_bad_json_reports_line(tmp_path):
    (tmp_path / "trec.jsonl").write_text(json.dumps(_record(0)) + "\n{oops\n", encoding="utf-8")
    with pytest.raises(ValueError, match="trec.jsonl:2"):
        lb.load_longbench("trec", data_dir=tmp_path)


def _official_zip(tmp_path, name="gov_report", n=2):
    zpath = tmp_path / "data.zip"
    with zipfile.ZipFile(zpath, "w") as zf:
        zf.writestr(f"data/{name}.jsonl", "".join(json.dumps(_record(i, name)) + "\n" for i in range(n)))
    return zpath


def test_load_from_official_zip(tmp_path):
    zpath = _official_zip(tmp_path)
    assert [r["_id"] for r in lb.load_longbench("gov_report", data_dir=zpath)] == ["id0", "id1"]
    with pytest.raises(FileNotFoundError, match="qmsum"):
        lb.load_longbench("qmsum", data_dir=zpath)


def test_hub_path_uses_datasets_load_dataset(monkeypatch):
    calls = []

    def load_dataset(repo, name, split, revision=None):
        calls.append((repo, name, split))
        return [_record(i) for i in range(4)]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    rows = lb.load_longbench("hotpotqa", limit=3)
    assert calls == [("THUDM/LongBench", "hotpotqa", "test")]
    assert len(rows) == 3 and rows[0]["_id"] == "id0"


def test_hub_script_error_falls_back_to_data_zip(monkeypatch, tmp_path):
    zpath = _official_zip(tmp_path, "samsum", 3)

    def load_dataset(repo, name, split, revision=None):
        raise RuntimeError("Dataset scripts are no longer supported, but found LongBench.py")

    def hf_hub_download(repo_id, filename, repo_type, revision=None):
        assert (repo_id, filename, repo_type) == ("THUDM/LongBench", "data.zip", "dataset")
        return str(zpath)

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    monkeypatch.setitem(sys.modules, "huggingface_hub", types.SimpleNamespace(hf_hub_download=hf_hub_download))
    assert [r["_id"] for r in lb.load_longbench("samsum")] == ["id0", "id1", "id2"]


# --------------------------------------------------------------------------- GovReport
def test_govreport_longbench_records(tmp_path):
    rows = [_record(i, "gov_report", answers=[f"summary {i}"]) for i in range(3)]
    _write_jsonl(tmp_path / "gov_report.jsonl", rows)
    rows = govreport.load_govreport_longbench(data_dir=tmp_path, limit=2)
    assert rows == [
        {"id": f"id{i}", "document": f"context {i}", "references": [f"summary {i}"], "length": 1000 * i,
         "source": "longbench/gov_report"}
        for i in range(2)
    ]  # fmt: skip


def test_govreport_full_from_jsonl(tmp_path):
    _write_jsonl(tmp_path / "test.jsonl", [{"report": f"r{i}", "summary": f"s{i}"} for i in range(3)])
    rows = govreport.load_govreport_full(data_dir=tmp_path, limit=2)
    assert [(r["id"], r["document"], r["references"]) for r in rows] == [
        ("govreport-test-0", "r0", ["s0"]),
        ("govreport-test-1", "r1", ["s1"]),
    ]


def test_govreport_full_from_hub_snapshot_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    (tmp_path / "document").mkdir()
    table = pa.table({"report": ["long report"], "summary": ["short"]})
    pq.write_table(table, tmp_path / "document" / "test-00000-of-00001.parquet")
    other = pa.table({"report": ["other"], "summary": ["x"]})
    pq.write_table(other, tmp_path / "document" / "validation-00000.parquet")
    (row,) = govreport.load_govreport_full("test", data_dir=tmp_path)
    assert row["document"] == "long report" and row["references"] == ["short"]
    assert govreport.load_govreport_full("validation", data_dir=tmp_path)[0]["document"] == "other"


def test_govreport_full_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="test"):
        govreport.load_govreport_full(data_dir=tmp_path)
    with pytest.raises(ValueError, match="valid"):
        govreport.load_govreport_full("dev", data_dir=tmp_path)
    _write_jsonl(tmp_path / "test.jsonl", [{"text": "no report column"}])
    with pytest.raises(ValueError, match="report"):
        govreport.load_govreport_full(data_dir=tmp_path)

"""ACLSum loaders: the packaged papers and a small fixture folder in the same layout."""

import json

import pytest

from kvbench.data import aclsum


def _fixture(root):
    (root / "paper_jsons").mkdir(parents=True)
    summary = {"challenge": "Problem X. ", "approach": "Method Y.", "outcome": "Result Z."}
    (root / "test.jsonl").write_text(
        json.dumps({"id": "P1", "title": "T1", "summary": summary, "sentences": {}}) + "\n", encoding="utf-8"
    )
    paper = {
        "paper_id": "broken",
        "abstract": "The abstract.",
        "pdf_parse": {"body_text": [{"text": "Para one."}, {"text": "  "}, {"text": "Para two."}]},
    }
    (root / "paper_jsons" / "P1.json").write_text(json.dumps(paper), encoding="utf-8")
    (root / "paper_jsons" / "P0.json").write_text(json.dumps(paper), encoding="utf-8")
    return root


def test_fixture_record_fields(tmp_path):
    root = _fixture(tmp_path)
    (rec,) = aclsum.load_aclsum("test", root=root)
    assert rec["id"] == "P1" and rec["title"] == "T1"
    assert rec["document"] == "Para one.\n\nPara two."
    assert rec["abstract"] == "The abstract."
    assert rec["references"] == ["Problem X.\nMethod Y.\nResult Z."]
    assert aclsum.load_aclsum("test", reference="abstract", root=root)[0]["references"] == ["The abstract."]
    assert len(aclsum.load_aclsum("test", reference="both", root=root)[0]["references"]) == 2


def test_fixture_bodies_sorted_by_file_name(tmp_path):
    root = _fixture(tmp_path)
    assert [i for i, _ in aclsum.load_aclsum_bodies(root)] == ["P0", "P1"]
    assert aclsum.aclsum_corpus_text(root) == "Para one.\n\nPara two.\n\nPara one.\n\nPara two."


def test_errors(tmp_path):
    with pytest.raises(ValueError, match="valid"):
        aclsum.load_aclsum("dev")
    with pytest.raises(ValueError, match="reference"):
        aclsum.load_aclsum("test", reference="title")
    with pytest.raises(FileNotFoundError, match="val.jsonl"):
        aclsum.load_aclsum("val", root=_fixture(tmp_path))


def test_packaged_splits():
    test = aclsum.load_aclsum("test")
    assert len(test) == 100
    assert len(aclsum.load_aclsum("train", limit=3)) == 3
    assert len(aclsum.load_aclsum("val")) == 50
    rec = test[0]
    assert rec["id"] == "E09-1056"
    assert set(rec["summaries"]) == {"challenge", "approach", "outcome"}
    assert rec["references"][0].split("\n") == [rec["summaries"][a].strip() for a in aclsum.ASPECTS]
    assert rec["abstract"].startswith("Handling terminology")
    assert len(rec["document"]) > 5 * len(rec["abstract"])


def test_packaged_bodies():
    bodies = aclsum.load_aclsum_bodies()
    assert len(bodies) == 250
    ids = [i for i, _ in bodies]
    assert ids == sorted(ids) and all(body for _, body in bodies)

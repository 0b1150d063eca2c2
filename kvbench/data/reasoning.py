"""Reasoning benchmarks' data: GSM8K, MATH-500, AIME 2024 / 2025, and the prompts of the reasoning setups.

Each set is a hub dataset, read through `datasets` from the hub or from a local copy in the hub's layout
(`data_path`: a folder with the split's files, or one parquet / jsonl / json file; kvbench.data.text_corpora):

  gsm8k    openai/gsm8k, config main, split test (1,319): question, answer ("... #### 72"; the gold is after "####")
  math500  HuggingFaceH4/MATH-500, split test (500): problem, solution, answer, subject, level, unique_id
  aime24   HuggingFaceH4/aime_2024, split train (30): id, problem, solution, answer, url, year (R-KV's data/aime24)
  aime25   math-ai/aime25, split test (30): id, problem, answer (kvpress's decoding evaluation)

`data_path=kvbench:smoke` reads three problems written for kvbench (not the sets' own problems), in the set's format:
GSM8K's (question, answer ending "#### N": kvbench/data/gsm8k_smoke.jsonl) for gsm8k, MATH-500's (problem, answer:
kvbench/data/reasoning_smoke.jsonl) for the others. The offline smoke experiment's data, for memory, not accuracy.

Prompts (`prompt_style`):
  r1   DeepSeek-R1's usage recommendation, in the user turn: the problem, then "Please reason step by step, and put
       your final answer within \\boxed{}." (no system prompt)
  rkv  R-KV's run_math.py template ("You are given a math problem. ... Final answer:  \\boxed{}")
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from kvbench.data.text_corpora import check_data_path, load_hub_dataset
from kvbench.errors import UserError


@dataclass(frozen=True)
class ReasoningSet:
    hub_id: str
    config: Optional[str]
    split: str
    question: str  # the column with the problem
    answer: str  # the column with the gold answer


SETS: dict[str, ReasoningSet] = {
    "gsm8k": ReasoningSet("openai/gsm8k", "main", "test", "question", "answer"),
    "math500": ReasoningSet("HuggingFaceH4/MATH-500", None, "test", "problem", "answer"),
    "aime24": ReasoningSet("HuggingFaceH4/aime_2024", None, "train", "problem", "answer"),
    "aime25": ReasoningSet("math-ai/aime25", None, "test", "problem", "answer"),
}

R1_SUFFIX = "Please reason step by step, and put your final answer within \\boxed{}."
RKV_TEMPLATE = ("You are given a math problem.\n\nProblem: {question}\n\n You need to solve the problem step by step. "
                "First, you need to provide the chain-of-thought, then provide the final answer.\n\n Provide the "
                "final answer in the format: Final answer:  \\boxed{{}}")
PROMPT_STYLES = ("r1", "rkv")
SMOKE_DATA = "kvbench:smoke"  # data_path of the packaged smoke problems
SMOKE_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reasoning_smoke.jsonl")  # MATH-500's format
GSM8K_SMOKE_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gsm8k_smoke.jsonl")


def local_path(data_path: Optional[str], name: str = "math500") -> Optional[str]:
    """data_path with the packaged smoke problems' name resolved to the file in set `name`'s format."""
    if data_path != SMOKE_DATA:
        return data_path
    return GSM8K_SMOKE_FILE if name == "gsm8k" else SMOKE_FILE


def reasoning_prompt(question: str, style: str = "r1") -> str:
    """The user turn of one problem in the chosen setup's wording."""
    if style == "r1":
        return f"{question}\n{R1_SUFFIX}"
    if style == "rkv":
        return RKV_TEMPLATE.format(question=question)
    raise UserError(f"invalid task.prompt_style={style!r}: choose one of {', '.join(PROMPT_STYLES)}")


def check_local(name: str, data_path: str) -> None:
    """UserError (one line) unless data_path holds the set's split, readable rows with the set's question and answer
    columns (before the model loads)."""
    s = SETS[name]
    check_data_path(local_path(data_path, name), s.split, s.config, columns=(s.question, s.answer))


def load_reasoning(name: str, data_path: Optional[str] = None, limit: Optional[int] = None,
                   revision: Optional[str] = None) -> list[dict]:
    """Records {id, question, answer, set, ...the row's other columns} of set `name`, in the hub's order (the
    hub's data at `revision`)."""
    s = SETS[name]
    ds = load_hub_dataset(s.hub_id, s.config, s.split, local_path(data_path, name), revision)
    out: list[dict] = []
    for i, row in enumerate(ds):
        if limit is not None and i >= limit:
            break
        missing = [c for c in (s.question, s.answer) if c not in row]
        if missing:
            raise UserError(f"{name} data has no {missing[0]!r} column (columns: {', '.join(row)})")
        rid = row.get("unique_id") or row.get("id")
        out.append({**{k: v for k, v in row.items() if isinstance(v, (str, int, float))},
                    "id": f"{name}-{rid if rid not in (None, '') else i}", "question": str(row[s.question]),
                    "answer": str(row[s.answer]), "set": name})
    return out


def gsm8k_gold(answer: str) -> str:
    """The final number of a GSM8K answer ("... #### 1,072" -> "1,072")."""
    return answer.split("####")[-1].strip()

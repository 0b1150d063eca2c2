"""Loader of the shipped documents (lm-eval's `custom_dataset`): no hub, no package needed."""
import json
from pathlib import Path

DATA_FILE = Path(__file__).resolve().parent / "essays_next_sentence.jsonl"


def load(**kwargs):
    import datasets

    with open(DATA_FILE, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})

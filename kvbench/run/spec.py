"""The rulebook: what a run's config means, in one place that the config, the plan, the lm-eval adapter, the
tasks and the results store import.

- storage: `method=<codec>` is shorthand for `method=full quant=<codec>`; a method and a quant that both name a
  codec is an error, never a silent winner (`resolve_storage`). Codec names and each codec's option defaults are
  read from the codec registry (kvbench.registry.CODECS), never from a hand-written list.
- eviction: whether a method drops tokens is declared by its class (`Method.evicts`), read through the method
  registry (`method_evicts`); a method that evicts nothing has no budget (recorded as null), whatever was set.
- budget and compression_ratio: `budget` a positive integer or null, `compression_ratio` a number in [0, 1) or
  null, never both (`check_budget`, `check_compression`, checked here once; methods check only their own
  relations, such as sinks < budget).
- numbers: integral floats are ints (`group_size=32.0` is `group_size=32`: one setting, one run id).
- the hashed config (`hashable_config`): the sections in HASHED_SECTIONS, resolved as above, so two spellings of
  one run get one run id; plus `data_sha256`, the digest of the local data files the task names
  (kvbench.run.data_digest), so an edited data file at the same path is a new run; likewise `model_sha256` (the
  model's config, tokenizer and weights), `method_files_sha256` (files a method's options name) and
  `method_source_sha256` (the method's own source files, a user's method file included).

This module imports only kvbench.errors, kvbench.run.data_digest and kvbench.registry: the registries load methods
and codecs by name when first asked, so the store and the reporting can import the rules without importing any
method or codec.
"""
from __future__ import annotations

import math
import os
from typing import Any, Optional

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from kvbench.run.data_digest import data_sha256, method_files_sha256, method_source_sha256, model_files_sha256
from kvbench.errors import UserError
from kvbench.registry import CODECS, METHODS, unknown_choice

SEED_MAX = 2**32 - 1  # numpy's limit (torch takes more; one range for every library)
EXACT_FLOAT_INT = 2**53  # integral floats up to this are exact integers
FULL_PRECISION = ("none", "full")  # the quant names that store KV in full precision
# The config sections that determine a result, hashed into the run id (compression_ratio too, when set).
HASHED_SECTIONS = ("model", "method", "quant", "task", "runtime", "budget", "seed")
DTYPES = ("float32", "bfloat16", "float16")  # model.dtype: the names torch gives these dtypes
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # also taken by the Python API
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")  # runtime.attention_backend (runtime.backends.selection)
SCHEDULES = ("mixed", "prefill_first")  # runtime.schedule (runtime.scheduler)
PREEMPTION_MODES = ("recompute", "swap", "auto")  # runtime.preemption (runtime.swap)
SPECULATIVE_MAX_TOKENS = 64  # runtime.speculative.num_tokens: the most draft tokens per round
# Task options with one canonical spelling (normalise_task): lengths are a list without repeats (a bare number is
# a list of one), a [lo, hi] range with lo == hi is that one number, and a rate spelled inf is the float inf.
TASK_LENGTH_LISTS = ("lengths",)
TASK_RANGES = ("input_tokens", "output_tokens")
TASK_RATES = ("request_rate",)
# (option, default value it implies another) -> that option's value: task.text_file=PATH selects corpus=text_file
# (perplexity), so `task.text_file=x` and `task.text_file=x task.corpus=text_file` are one run, recorded alike.
TASK_IMPLIED = {("text_file", "corpus", "pg_essays"): "text_file"}
INF_WORDS = ("inf", "+inf", ".inf", "+.inf", "infinity", "+infinity")
BOOL_WORDS = {"true": True, "false": False}
# The most a count may be (docs/configuration.md lists them): past these a run would take days or hang, so the
# value is a typo. Tokens: 2**24 (16.7M), as task.max_tokens. Task options are checked by name (check_task_counts).
TOKENS_MAX = 2**24
TASK_COUNT_MAX = {"num_requests": 100_000, "limit": 1_000_000, "num_documents": 1_000_000,
                  "bootstrap_iters": 1_000_000, "num_fewshot": 1_000, "max_new_tokens": TOKENS_MAX,
                  "max_gen_toks": TOKENS_MAX, "max_length": TOKENS_MAX, "lengths": TOKENS_MAX}
LIST_ENTRIES_MAX = 1_000  # entries of a task's list of lengths, depths, tasks or datasets
RUNTIME_COUNT_MAX = {"batch_size": 65_536, "max_num_seqs": 65_536, "prefill_chunk_size": TOKENS_MAX,
                     "max_num_batched_tokens": TOKENS_MAX}


def check_positive(where: str, value: Any, *, allow_none: bool = False, minimum: int = 1,
                   maximum: Optional[int] = None) -> None:
    """UserError "invalid where=value: expected an integer >= minimum" unless value is such an integer (or None
    with allow_none)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum \
            or (maximum is not None and value > maximum):
        allowed = f"an integer >= {minimum}" if maximum is None else f"an integer from {minimum} to {maximum}"
        allowed += " or null" if allow_none else ""
        raise UserError(f"invalid {where}={value!r}: expected {allowed}")


def dtype_name(value: Any, where: str = "model.dtype", *, aliases: bool = False) -> str:
    """The dtype's name in DTYPES; with aliases=True also fp32 / bf16 / fp16. UserError naming the choices otherwise.

    The config takes the names only (its raw value names the run, so two spellings would be two run ids)."""
    name = DTYPE_ALIASES.get(value, value) if aliases and isinstance(value, str) else value
    if name not in DTYPES:
        allowed = ", ".join(DTYPES) + (f" (or {', '.join(DTYPE_ALIASES)})" if aliases else "")
        raise UserError(f"invalid {where}={value!r}: choices are {allowed}")
    return name


def results_path(value: Any) -> str:
    """results_dir as an absolute path, `~` expanded: the one spelling used for run folders, Hydra's sweep folder
    and runs.jsonl alike."""
    if value is None or not str(value).strip():
        raise UserError(f"invalid results_dir={value!r}: expected a folder (results_dir=. writes into the current "
                        "one)")
    return os.path.abspath(os.path.expanduser(str(value)))


def normalise_numbers(values: Any, defaults: Optional[dict] = None) -> Any:
    """Integral floats as ints (`group_size=32.0` is `group_size=32`: one setting, one run id), in dicts and lists.
    With `defaults` (an option's declared default), an option whose default is a float keeps a float (`0` -> `0.0`).
    Floats beyond 2**53 are left as written (refused where an integer is expected)."""
    if isinstance(values, dict):
        out = {}
        for key, value in values.items():
            default = (defaults or {}).get(key)
            if isinstance(default, float) and not isinstance(value, bool) and isinstance(value, int):
                out[key] = float(value)
            elif isinstance(default, float):
                out[key] = value
            else:
                out[key] = normalise_numbers(value)
        return out
    if isinstance(values, list):
        return [normalise_numbers(v) for v in values]
    if isinstance(values, float) and values.is_integer() and abs(values) <= EXACT_FLOAT_INT:
        return int(values)
    return values


def check_bool(where: str, value: Any) -> None:
    """The one rule for a true/false setting: True or False (spelled `true` / `false`), nothing else; UserError
    naming the value otherwise."""
    if not isinstance(value, bool):
        raise UserError(f"invalid {where}={value!r}: expected true or false")


def check_bool_spellings(overrides: list, bool_keys: Any) -> None:
    """Command-line overrides of true/false settings (`bool_keys`, dotted) spelled other than true / false:
    UserError. OmegaConf would read yes/no/on/off/y/n/1/0 as booleans, Hydra's parser reads only true / false as
    such, so a value that reaches a boolean key as text (or a number) was spelled otherwise. Overrides Hydra cannot
    parse are left to Hydra (its own one-line error)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    for text in overrides:
        if text.startswith("-") or "=" not in text:
            continue
        try:
            (override,) = parser.parse_overrides([text])
        except (HydraException, ValueError):
            continue
        key = override.key_or_group
        if key not in bool_keys or override.value() is None:
            continue
        values = list(override.sweep_iterator()) if override.is_sweep_override() else [override.value()]
        for value in values:
            check_bool(key, value)


def integral_spellings(overrides: list, int_keys: Any) -> list:
    """The command-line overrides with integral floats of integer settings (`int_keys`, dotted) spelled as integers
    (`budget=1e12` -> `budget=1000000000000`, `runtime.block_size=16.0` -> `16`, each value of a sweep), as the docs
    promise: Hydra's typed schema would refuse them as "expected an integer". An integral float beyond 2**53 (not an
    exact integer) is refused as too large, naming it; other values are left to Hydra and the checks."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ChoiceSweep
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    out = []
    for text in overrides:
        if text.startswith("-") or "=" not in text:
            out.append(text)
            continue
        try:
            (override,) = parser.parse_overrides([text])
        except (HydraException, ValueError):
            out.append(text)
            continue
        key, value = override.key_or_group, override.value()
        if key not in int_keys or value is None:
            out.append(text)
            continue
        if override.is_sweep_override():
            if not isinstance(value, ChoiceSweep):
                out.append(text)
                continue
            values = list(override.sweep_iterator())
        else:
            values = [value]
        spelled = [_as_int(key, v) for v in values]
        if all(a is b for a, b in zip(spelled, values)):
            out.append(text)
        else:
            out.append(text.split("=", 1)[0] + "=" + ",".join(str(v) for v in spelled))
    return out


def _as_int(key: str, value: Any) -> Any:
    """An integral float as an int; UserError naming one too large to be an exact integer; anything else as given."""
    if not isinstance(value, float) or not math.isfinite(value) or not value.is_integer():
        return value
    if abs(value) > EXACT_FLOAT_INT:
        raise UserError(f"invalid {key}={value!r}: too large (beyond 2**53 = {EXACT_FLOAT_INT:,}, a float is not an "
                        f"exact integer); expected an integer")
    return int(value)


def _canonical_bool(value: Any) -> Any:
    """1 / 0 and "true" / "false" as True / False; anything else as given."""
    if isinstance(value, str) and value.lower() in BOOL_WORDS:
        return BOOL_WORDS[value.lower()]
    if isinstance(value, int) and not isinstance(value, bool) and value in (0, 1):
        return bool(value)
    return value


def normalise_runtime(runtime: dict) -> dict:
    """The runtime section in its one spelling: `prefix_caching=1` is `prefix_caching=true` (one run id)."""
    out = dict(runtime)
    if "prefix_caching" in out:
        out["prefix_caching"] = _canonical_bool(out["prefix_caching"])
    if out.get("tensor_parallel") == 1:  # the default: runs from before the option keep their ids
        out.pop("tensor_parallel")
    return out


def normalise_task(task: dict) -> dict:
    """A task's options in their one spelling, so two spellings of one run get one run id and the task sees one
    form: integral floats as ints; `lengths=4096` is `[4096]` and `[1024, 1024]` is `[1024]`; a range
    `input_tokens=[512, 512]` is `512`; `request_rate=.inf` (or inf, infinity) is the float inf; `text_file`
    set with the default corpus is `corpus=text_file` (TASK_IMPLIED). Values that are
    none of these are left for the task to refuse."""
    out = normalise_numbers(dict(task))
    for key in TASK_LENGTH_LISTS:
        value = out.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = [value]
        if isinstance(value, list):
            out[key] = [v for i, v in enumerate(value)
                        if not any(v == w and type(v) is type(w) for w in value[:i])]
    for key in TASK_RANGES:
        value = out.get(key)
        if isinstance(value, list) and len(value) == 2 and value[0] == value[1] \
                and type(value[0]) is type(value[1]) and not isinstance(value[0], bool):
            out[key] = value[0]
    for key in TASK_RATES:
        value = out.get(key)
        if isinstance(value, str) and value.strip().lower() in INF_WORDS:
            out[key] = math.inf
    for (key, implied, default), value in TASK_IMPLIED.items():
        if isinstance(out.get(key), str) and out[key].strip() and out.get(implied) == default:
            out[implied] = value
    return out


def check_task_counts(task: dict) -> None:
    """UserError naming a task option past its bound in TASK_COUNT_MAX (a number, or any entry of a list), or a
    list option with more than LIST_ENTRIES_MAX entries; types and lower bounds are the task's to check."""
    for key, value in task.items():
        if isinstance(value, list) and len(value) > LIST_ENTRIES_MAX:
            raise UserError(f"invalid task.{key}: {len(value):,} entries; expected at most {LIST_ENTRIES_MAX:,}")
        most = TASK_COUNT_MAX.get(key)
        if most is None:
            continue
        for x in (value if isinstance(value, list) else [value]):
            if isinstance(x, (int, float)) and not isinstance(x, bool) and x > most:
                raise UserError(f"invalid task.{key}={value!r}: expected at most {most:,}")


# --------------------------------------------------------------------------- storage codecs
def codec_names() -> list[str]:
    """Every storage codec's name, from the codec registry (none and full: full precision)."""
    return CODECS.names()


def codec_defaults(name: str) -> dict[str, Any]:
    """The options codec `name` takes, with their defaults (declared once, with the codec's builder)."""
    return dict(CODECS.get(name).defaults)


def check_codec_options(name: str, options: dict[str, Any], where: str = "quant") -> dict[str, Any]:
    """The codec's options with null ones at their defaults; UserError naming an option the codec does not take
    (as `where`.option: quant, or method for the shorthand method=<codec>)."""
    defaults = codec_defaults(name)
    bad = sorted(set(options) - set(defaults))
    if bad:
        valid = ", ".join(sorted(defaults)) or "(none)"
        raise UserError(f"unknown option {where}.{bad[0]} for codec {name!r}; valid options are {valid}")
    return {k: (defaults[k] if options.get(k) is None else options[k]) for k in defaults}


def resolve_storage(method_name: str, method_options: dict[str, Any], quant_name: Any,
                    quant_options: dict[str, Any]) -> tuple[str, dict[str, Any], str, dict[str, Any]]:
    """The one route to a codec: `method=<codec>` becomes `method=full quant=<codec>` (the method's options are
    the codec's); quant=full is quant=none. A method and a quant that both name a codec is an error, never a
    silent winner; unknown codecs and codec options raise UserError. Returns (method_name, method_options,
    quant_name, quant_options), integral floats as ints (a codec's float options kept floats)."""
    names = codec_names()
    quant_name = "none" if quant_name in (None, "full") else quant_name
    if not isinstance(quant_name, str) or quant_name not in names:
        raise unknown_choice("quant", quant_name, [c for c in names if c != "full"])
    method_options, quant_options = dict(method_options), dict(quant_options)
    if method_name in names and method_name not in FULL_PRECISION:
        if quant_name != "none":
            raise UserError(f"method={method_name} and quant={quant_name} both choose a storage codec: use "
                            f"method=full quant={quant_name}, or method=<eviction method> quant={quant_name}")
        method_name, quant_name, quant_options, method_options = "full", method_name, method_options, {}
        check_codec_options(quant_name, quant_options, where="method")  # the options the user set on method.
    check_codec_options(quant_name, quant_options)
    return (method_name, normalise_numbers(method_options), quant_name,
            normalise_numbers(quant_options, codec_defaults(quant_name)))


# --------------------------------------------------------------------------- eviction, budget, ratio
def method_evicts(name: str) -> bool:
    """Whether method `name` ever drops tokens: its class's `evicts` (read through the method registry). An
    unknown name counts as evicting (its budget is kept; the method is refused when it is built)."""
    if name not in METHODS:
        return True
    return bool(METHODS.get(name).evicts)


def method_uses_budget(name: str) -> bool:
    """Whether `budget` means something to method `name`: tokens kept (an eviction method) or tokens read per decode
    step (a retrieval method, `Method.retrieves`: quest)."""
    return method_evicts(name) or bool(name in METHODS and METHODS.get(name).retrieves)


def method_retrieves(name: str) -> bool:
    """Whether method `name` reads selected blocks in decode steps (`Method.retrieves`: quest)."""
    return name in METHODS and bool(METHODS.get(name).retrieves)


def check_retrieval_storage(method_name: str, quant_name: str) -> None:
    """A retrieval method (quest) bounds keys cached after RoPE: a codec that stores keys before RoPE (kvquant) is
    refused; the others (kivi, int8, fp8) keep page summaries of the keys as their blocks decode."""
    retrieves = method_name in METHODS and METHODS.get(method_name).retrieves
    if not retrieves or quant_name in ("none", "full") or quant_name not in CODECS.names():
        return
    if getattr(CODECS.get(quant_name).codec_cls, "pre_rope_keys", False):
        ok = [n for n in CODECS.names() if n not in ("full", "none")
              and not getattr(CODECS.get(n).codec_cls, "pre_rope_keys", False)]
        raise UserError(f"method={method_name} with quant={quant_name}: {quant_name} stores keys before RoPE, and "
                        f"page retrieval bounds keys after it; valid quants: none, {', '.join(ok)}")


def check_question_source(name: str, method_options: dict[str, Any], task_options: dict[str, Any]) -> None:
    """A method that reads the prompt's question (its class's `reads_question`, Finch's window) needs a task that
    compresses the question with its context (task.compress_question=true: the task tells the method its extent) or
    its own `window`; refused in one line before the model loads otherwise."""
    cls = METHODS.get(name) if name in METHODS else None
    if cls is None or not cls.reads_question or method_options.get("window") is not None:
        return
    if task_options.get("compress_question") is not True:
        raise UserError(f"method={name} reads the question's tokens: set task.compress_question=true (a task with a "
                        f"question: ruler, longbench, needle) or method.window=N (the last N prompt tokens)")


def check_rewrite_storage(name: str, method_options: dict[str, Any], quant_name: str) -> None:
    """A method that rewrites cached K/V in place (its class's `rewrites_cache(options)`: Finch's re-rotated keys,
    merged values) needs full-precision storage: with a storage codec it is refused in one line."""
    cls = METHODS.get(name) if name in METHODS else None
    rewrites = getattr(cls, "rewrites_cache", None)
    if quant_name != "none" and rewrites is not None and rewrites(method_options):
        raise UserError(f"method={name} rewrites cached K/V in place, which quant={quant_name} stores packed: use "
                        f"quant=none" + (" or method.rerotate_keys=false" if name == "finch" else ""))


def check_budget(budget: Any) -> Optional[int]:
    """`budget`: the most KV tokens kept per sequence, per layer, per kv-head; a positive integer or null."""
    check_positive("budget", budget, allow_none=True)
    return budget


def check_compression(budget: Any, compression_ratio: Any) -> Optional[float]:
    """`compression_ratio`: the fraction of each prompt's KV removed at prefill (kvpress's meaning; 0.0 = keep
    all), a number in [0, 1), exclusive with `budget`; each eviction method turns it into a per-sequence budget
    (methods/eviction.py). Returns it as a float (or None); UserError on a bad value or both knobs set."""
    r = compression_ratio
    if r is None:
        return None
    if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 <= r < 1:
        raise UserError(f"invalid compression_ratio={r!r}: expected a number in [0, 1) (the fraction of each "
                        "prompt's KV removed) or null")
    if budget is not None:
        raise UserError(f"budget={budget} and compression_ratio={r} are both set: choose one (budget = KV tokens "
                        "kept per sequence, layer and kv-head; compression_ratio = fraction of each prompt removed)")
    return float(r)


def check_threshold(method_options: dict, budget: Optional[int], compression_ratio: Optional[float]) -> None:
    """`method.threshold` (a threshold rule, methods/dms.py: evict every token scored below it): a number, and
    exclusive with `budget` and `compression_ratio` (it decides how much stays); UserError otherwise."""
    t = method_options.get("threshold")
    if t is None:
        return
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t):
        raise UserError(f"invalid method.threshold={t!r}: expected a finite number (tokens scored below it are "
                        f"evicted)")
    if budget is not None or compression_ratio is not None:
        knob = f"budget={budget}" if budget is not None else f"compression_ratio={compression_ratio}"
        raise UserError(f"method.threshold={t} and {knob} are both set: a threshold decides how much is kept; "
                        "choose one")


def kept_budget(method_name: str, budget: Optional[int],
                compression_ratio: Optional[float]) -> tuple[Optional[int], Optional[float]]:
    """(budget, compression_ratio) as a run of `method_name` keeps them (checked before: check_budget,
    check_compression): both None for a method that evicts nothing (every budget of it is the same run)."""
    if not method_uses_budget(method_name):
        return None, None
    return budget, compression_ratio


# --------------------------------------------------------------------------- the hashed config
def raw_value(cfg: Any, full_key: str) -> Any:
    """The value at `full_key` (a.b[0].c) as written, interpolations unresolved; None when not found."""
    node: Any = OmegaConf.to_container(cfg, resolve=False) if OmegaConf.is_config(cfg) else cfg
    for part in full_key.replace("]", "").replace("[", ".").split("."):
        try:
            node = node[int(part)] if isinstance(node, list) else node[part]
        except (KeyError, IndexError, ValueError, TypeError):
            return None
    return node


def _raw_hashable(root: Any) -> dict:
    """The hashed sections, resolved (as written where an interpolation cannot be resolved: validate refuses it)."""
    out = {}
    for k in HASHED_SECTIONS:
        if k not in root:
            continue
        try:
            out[k] = OmegaConf.to_container(root[k], resolve=True) if OmegaConf.is_config(root[k]) else root[k]
        except OmegaConfBaseException:
            out[k] = raw_value(root, k)
    if root.get("compression_ratio") is not None:  # absent when null: runs without it keep their ids
        out["compression_ratio"] = root["compression_ratio"]
    return out


def _weights_matter(model: dict) -> bool:
    """Whether model.weights is part of a run's identity: only `quantized` (runs before it existed, and every
    `dequantize` run, read the weights in fp32 and keep their ids) of a GGUF (a .gguf, a folder holding one, a
    packaged model: elsewhere the option changes nothing)."""
    if model.get("weights") in (None, "dequantize"):
        return False
    path, gguf = str(model.get("path") or ""), model.get("gguf_file")
    if gguf or path.endswith(".gguf") or path.startswith("packaged:"):
        return True
    try:
        folder = os.path.expanduser(path)
        return bool(path) and os.path.isdir(folder) and any(n.endswith(".gguf") for n in os.listdir(folder))
    except OSError:
        return False


def hashable_config(root: Any) -> dict:
    """The parts of a config that determine the result, in resolved form (storage codec moved to `quant`, budget
    null for a method that evicts nothing), so two spellings of one run hash alike. Never raises: a config that
    does not validate hashes as written (and is refused by config.validate)."""
    data = _raw_hashable(root)
    try:
        method = dict(data.get("method") or {})
        quant = dict(data.get("quant") or {"name": "none"})
        m_name, m_opts, q_name, q_opts = resolve_storage(str(method.pop("name", "")), method,
                                                         str(quant.pop("name", "none")), quant)
        data["method"] = {"name": m_name, **m_opts}
        quiet = getattr(CODECS.get(q_name), "unhashed_defaults", {})  # options added later, at their defaults
        data["quant"] = {"name": q_name, **{k: v for k, v in q_opts.items() if not (k in quiet and v == quiet[k])}}
        if isinstance(data.get("task"), dict):
            data["task"] = normalise_task(data["task"])
        if isinstance(data.get("runtime"), dict):
            data["runtime"] = normalise_runtime(data["runtime"])
        if not method_uses_budget(m_name):
            if data.get("budget") is not None:
                data["budget"] = None
            data.pop("compression_ratio", None)
    except Exception:
        pass
    digest = data_sha256(data.get("task"))  # the content of the data files the task names (kvbench.run.data_digest)
    if digest is not None:  # absent without local data files: those runs keep their ids
        data["data_sha256"] = digest
    files = method_files_sha256(data.get("method"))  # the files a method reads (KVzap's surrogate, DuoAttention's
    if files is not None:  # patterns): absent when it names none
        data["method_files_sha256"] = files
    if isinstance(data.get("model"), dict) and not _weights_matter(data["model"]):
        data["model"] = {k: v for k, v in data["model"].items() if k not in ("weights", "quant_activations")}
    if isinstance(data.get("model"), dict) and data["model"].get("quant_activations") in (None, "fp32"):
        data["model"] = {k: v for k, v in data["model"].items() if k != "quant_activations"}  # as before the option
    model_files = model_files_sha256(data.get("model"))  # the model's config, tokenizer and weights (absent for the
    if model_files is not None:  # packaged model, identified by its package's version)
        data["model_sha256"] = model_files
    method = data.get("method") if isinstance(data.get("method"), dict) else {}
    names = [method.get("name")] + ([method["base"]] if isinstance(method.get("base"), str) else [])
    source = method_source_sha256([n for n in names if isinstance(n, str) and n])  # a user's method file edited
    if source is not None:  # is another run, as an edited data file is
        data["method_source_sha256"] = source
    return data

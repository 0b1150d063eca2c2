"""The docs say what the code does: docs/configuration.md's groups table lists every option of every group (the
config folders and the method and task registries), docs/experiments.md has a row per experiment whose smoke run
count is the sweep's, docs/methods.md's method table and the README's codec and task tables and its bad-input
example hold, and every link between the Markdown files reaches a file and a heading that exist."""
from __future__ import annotations

import itertools
import os
import re

import pytest

from tests.app.test_experiments import EXPERIMENTS_BIG_SLOW, _compose, sweep_axes
from tests.harness_fakes import CONF_DIR

from kvbench.methods import available_methods
from kvbench.run.spec import hashable_config
from kvbench.store.naming import run_id_for
from kvbench.tasks import available_tasks

REPO = os.path.dirname(CONF_DIR)
GROUPS = ("model", "method", "quant", "task", "runtime", "logger")


def _read(path: str) -> str:
    with open(os.path.join(REPO, path)) as f:
        return f.read()


def _options(group: str) -> set:
    return {f[:-5] for f in os.listdir(os.path.join(CONF_DIR, group)) if f.endswith(".yaml")}


def _table_rows(text: str, heading: str) -> dict:
    """{first cell: [cells]} of the Markdown table under `heading` (the first table after it)."""
    section = text[text.index(heading):]
    rows, started = {}, False
    for line in section.splitlines()[1:]:
        if line.startswith("|"):
            started = True
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not set(cells[0]) <= set("- "):
                rows[cells[0]] = cells
        elif started:
            break
    return rows


def _names(cell: str) -> set:
    return set(re.findall(r"`([\w.-]+)`", cell))


def _composed_on(group: str, option: str) -> str | None:
    """The option another YAML of the group composes on (its `defaults:` entry besides _self_), else None."""
    import yaml

    with open(os.path.join(CONF_DIR, group, f"{option}.yaml")) as f:
        defaults = (yaml.safe_load(f) or {}).get("defaults") or []
    bases = [d for d in defaults if isinstance(d, str) and d != "_self_"]
    return bases[0] if bases else None


def test_every_method_and_task_is_registered_and_configured():
    codecs = _options("quant") - {"none"}
    methods = set(available_methods())
    # kivi, ...: shorthands for method=full quant=...; kvpress's registry rows (decoding_tova, kvzip_plus, ...) are
    # YAMLs composed on a registered method's YAML
    rows = _options("method") - methods - codecs
    assert methods | codecs <= _options("method"), sorted(methods | codecs - _options("method"))
    for row in sorted(rows):
        base, seen = row, set()
        while base is not None and base not in methods and base not in seen:
            seen.add(base)
            base = _composed_on("method", base)
        assert base in methods, f"conf/method/{row}.yaml is neither a registered method nor composed on one"
    assert _options("task") == set(available_tasks())


@pytest.mark.parametrize("group", GROUPS)
def test_the_configuration_guide_lists_every_option_of_each_group(group):
    rows = _table_rows(_read("docs/configuration.md"), "## Groups and options")
    assert f"`{group}`" in rows, sorted(rows)
    listed = _names(rows[f"`{group}`"][1])
    missing, extra = sorted(_options(group) - listed), sorted(listed - _options(group))
    assert listed == _options(group), f"docs/configuration.md, group {group}: missing {missing}, not an option {extra}"


def test_the_readme_tables_list_every_method_codec_and_task():
    """docs/methods.md's table lists every method (the README links it); the README lists every codec and task."""
    readme = _read("README.md")
    methods = set().union(*(_names(k) for k in _table_rows(_read("docs/methods.md"), "## Decode and prefill policies")))
    assert methods == set(available_methods()), sorted(methods ^ set(available_methods()))
    codecs = set().union(*(_names(k) for k in _table_rows(readme, "| quant | what is stored |")))
    assert codecs == _options("quant") - {"none"}
    tasks = set().union(*(_names(k) for k in _table_rows(readme, "## Tasks")))
    assert tasks == set(available_tasks()), sorted(tasks ^ set(available_tasks()))


@pytest.mark.parametrize("guide", ["README.md", "docs/configuration.md"])
def test_the_bad_input_example_is_what_kvbench_prints(guide):
    """The example's line is the start of what the CLI prints (kvbench.api.compose_config: the CLI's wording)."""
    from kvbench.api import compose_config

    [shown] = re.findall(r"kvbench: error: unknown method 'nope': [^\n]*", _read(guide))
    with pytest.raises(ValueError) as info:
        compose_config(["method=nope"])
    printed = f"kvbench: error: {info.value}"
    assert printed.startswith(shown.rstrip(". ").rstrip(", ")), (shown, printed)


def _smoke_runs(name: str) -> tuple[int, int]:
    """(sweep jobs, distinct runs) of an experiment's smoke sweep: jobs that resolve to one run id (a row that runs
    once whatever the swept ratio) are one run."""
    base, axes = sweep_axes(name, "smoke")
    jobs = list(itertools.product(*axes))
    runs = {run_id_for(hashable_config(_compose(base + list(job)))) for job in jobs}
    return len(jobs), len(runs)


# every experiment; composing every job of the big sweeps (kvpress_leaderboard, budget_sweep, reasoning_decode) runs
# under `make test-all`, as test_experiments' whole-sweep checks do
@pytest.mark.parametrize("name", EXPERIMENTS_BIG_SLOW)
def test_the_experiments_guide_states_each_smoke_sweeps_run_count(name):
    rows = _table_rows(_read("docs/experiments.md"), "## Running an experiment")
    assert f"`{name}`" in rows, f"docs/experiments.md has no row for {name}"
    smoke = rows[f"`{name}`"][2]
    jobs, runs = _smoke_runs(name)
    stated_runs = [int(n.replace(",", "")) for n in re.findall(r"(\d[\d,]*) runs\b", smoke)]
    stated_jobs = [int(n.replace(",", "")) for n in re.findall(r"(\d[\d,]*) sweep jobs\b", smoke)]
    assert stated_runs == [runs], f"{name}: the smoke sweep has {runs} runs ({jobs} jobs); the guide says {smoke!r}"
    assert stated_jobs in ([], [jobs]), f"{name}: the smoke sweep has {jobs} jobs; the guide says {smoke!r}"


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped (letters, digits, spaces, - and _ kept),
    spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(markdown: str) -> set:
    """The anchors of a Markdown file's headings (outside code blocks; a repeated heading's later ones get -1, -2...)
    and its explicit `<a id="...">` anchors (stable names for sections whose headings carry dates and commits)."""
    seen: dict = {}
    out = set(re.findall(r'<a (?:id|name)="([^"]+)"', markdown))
    for line in _outside_code(markdown):
        m = re.match(r"#{1,6} +(.*?) *#*$", line)
        if m:
            slug = _slug(m.group(1))
            n = seen.get(slug, 0)
            out.add(slug if n == 0 else f"{slug}-{n}")
            seen[slug] = n + 1
    return out


def _outside_code(markdown: str) -> list:
    lines, fenced = [], False
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def _doc_files() -> list:
    return ["README.md"] + sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(REPO, "docs"))
                                  if f.endswith(".md"))


def test_the_anchor_slugs_follow_github():
    assert _slug("Figures once quoted in the code's comments") == "figures-once-quoted-in-the-codes-comments"
    assert _slug("Storage codecs: the `quant` group") == "storage-codecs-the-quant-group"
    assert _slug("A second pass (2026-12-06, evening): host work") == "a-second-pass-2026-12-06-evening-host-work"
    assert _anchors("# A\n## A\n```\n# not a heading\n```\n") == {"a", "a-1"}


@pytest.mark.parametrize("doc", _doc_files())
def test_every_link_between_the_docs_reaches_a_file_and_heading(doc):
    """A relative link [text](path#anchor) in README.md or docs/*.md: the file exists, and the anchor is one of its
    headings' (a section moved to another page leaves no dead link behind)."""
    broken = []
    for line in _outside_code(_read(doc)):
        for target in re.findall(r"\]\(([^)\s]+)\)", re.sub(r"`[^`]*`", "", line)):
            if re.match(r"[a-z]+:", target):  # http(s), mailto: not checked here
                continue
            path, _, anchor = target.partition("#")
            file = os.path.normpath(os.path.join(os.path.dirname(doc), path)) if path else doc
            if not os.path.exists(os.path.join(REPO, file)):
                broken.append(f"{target} (no file {file})")
            elif anchor and file.endswith(".md") and anchor not in _anchors(_read(file)):
                broken.append(f"{target} (no heading #{anchor} in {file})")
    assert broken == [], f"{doc}: {broken}"

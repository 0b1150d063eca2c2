"""One `all` expansion and one unknown-name refusal for ruler's and scbench's task.tasks and longbench's
task.datasets (kvbench/tasks/selection.py)."""
from __future__ import annotations

import pytest

from kvbench.data import longbench as lb
from kvbench.data import ruler as rd
from kvbench.data import scbench as sd
from kvbench.errors import UserError
from kvbench.tasks import longbench, ruler, scbench
from kvbench.tasks.selection import expand_names

PARSERS = {"ruler": (ruler._task_names, "tasks", "RULER task"),
           "scbench": (scbench._task_names, "tasks", "SCBench task"),
           "longbench": (longbench._dataset_names, "datasets", "LongBench dataset")}


def test_groups_expand_in_order_each_name_once():
    groups = {"all": ("a", "b", "c"), "ab": ("a", "b")}
    assert expand_names(["c", "ab", "all"], option="x", what="thing", groups=groups, choices="abc") == ["c", "a", "b"]
    assert expand_names("b", option="x", what="thing", groups=groups, choices="abc") == ["b"]


def test_the_three_tasks_select_as_before():
    assert ruler._task_names("all") == list(rd.TASK_NAMES)
    assert ruler._task_names(["vt", "niah_single_1", "vt"]) == ["vt", "niah_single_1"]
    assert scbench._task_names("all") == list(sd.GENERATED_TASKS)
    assert scbench._task_names("all", "hub") == list(sd.HUB_TASKS)
    assert scbench._task_names(["kv", "scbench_kv", "vt"]) == ["scbench_kv", "scbench_vt"]
    assert longbench._dataset_names("all") == list(lb.LONGBENCH_DATASETS)
    assert longbench._dataset_names(["e", "trec"])[:len(lb.LONGBENCH_E_DATASETS)] == list(lb.LONGBENCH_E_DATASETS)


@pytest.mark.parametrize("task", PARSERS)
def test_unknown_and_empty_are_refused_in_one_form(task):
    parse, option, what = PARSERS[task]
    with pytest.raises(UserError) as info:
        parse(["all", "nope"])
    message = str(info.value)
    assert message.startswith(f"unknown {what} 'nope' in task.{option}: choices are all, ") and "\n" not in message
    with pytest.raises(UserError, match=rf"^task\.{option} is empty: name {what}s or all"):
        parse([])


def test_refusals_list_every_valid_choice():
    with pytest.raises(UserError) as info:
        longbench._dataset_names("nope")
    assert str(info.value).startswith("unknown LongBench dataset 'nope' in task.datasets: choices are all, en, zh, e, ")
    assert all(name in str(info.value) for name in lb.ALL_DATASETS)
    with pytest.raises(UserError) as info:
        scbench._task_names("scbench_nope")
    assert "'scbench_nope'" in str(info.value) and "repoqa_and_kv (or their scbench_ names)" in str(info.value)

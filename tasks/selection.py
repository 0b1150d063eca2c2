"""A task option that selects sub-tasks or datasets by name: groups (`all`, ...) expanded, unknown names refused.

    expand_names(["all"], option="tasks", what="RULER task", groups={"all": TASK_NAMES}, choices=TASK_NAMES)

One place for ruler's and scbench's task.tasks and longbench's task.datasets, so their refusals read alike:

    unknown RULER task 'niah' in task.tasks: choices are all, niah_single_1, ...
    task.tasks is empty: name RULER tasks or all
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

from kvbench.errors import UserError


def expand_names(value: Any, *, option: str, what: str, groups: Mapping[str, Sequence[str]],
                 choices: Sequence[str], canonical: Callable[[str], str] = str,
                 shown: Optional[str] = None) -> list[str]:
    """The names `value` selects (one name or group, or a list of them), in order, each once, groups expanded.

    option: the task option's name (task.<option> in messages); what: one selected thing in words ("RULER task");
    groups: group name -> its members; choices: every valid name; canonical: a name's spelling in `choices` (scbench:
    kv -> scbench_kv); shown: how the valid names are listed in the refusal (default: choices, comma-separated).
    UserError (one line, naming the bad value and the choices) for an empty selection or an unknown name."""
    items = [value] if isinstance(value, str) else list(value or [])
    group_list = ", ".join(groups)
    if not items:
        raise UserError(f"task.{option} is empty: name {what}s or {group_list}")
    names: list[str] = []
    for item in items:
        for name in groups.get(str(item), (str(item),)):
            full = canonical(name)
            if full not in choices:
                raise UserError(f"unknown {what} {name!r} in task.{option}: choices are {group_list}, "
                                f"{shown or ', '.join(choices)}")
            if full not in names:
                names.append(full)
    return names

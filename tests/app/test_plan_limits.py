"""The draft budget and the swap space are checked against what the task and the host can hold, both ways."""
from types import SimpleNamespace

import pytest

from kvbench.run import plan
from kvbench.errors import UserError
from kvbench.tasks import build_task


def _settings(budget, task_name="throughput", swap=None):
    spec = SimpleNamespace(budget=budget)
    return SimpleNamespace(task_name=task_name, runtime=SimpleNamespace(speculative=spec, swap_bytes=swap))


def test_a_draft_budget_below_the_longest_context_is_accepted_and_at_it_refused():
    task = build_task("throughput", {"name": "throughput", "input_tokens": 100, "output_tokens": 20})
    tokens, why = task.longest_context()
    assert tokens == 120 and "task.input_tokens" in why
    shape = SimpleNamespace(max_positions=8192)
    plan._check_draft_budget(_settings(119), task, shape, draft_evicts=True)  # compresses: accepted
    with pytest.raises(UserError, match=r"runtime.speculative.budget=120: task=throughput makes contexts of at most "
                                        r"120 tokens.*expected a budget below 120"):
        plan._check_draft_budget(_settings(120), task, shape, draft_evicts=True)
    plan._check_draft_budget(_settings(500), task, shape, draft_evicts=False)  # a codec draft has no budget


def test_without_a_task_bound_the_model_positions_bound_the_draft_budget():
    task = SimpleNamespace()  # no longest_context
    shape = SimpleNamespace(max_positions=2048)
    plan._check_draft_budget(_settings(2047, "needle"), task, shape, draft_evicts=True)
    with pytest.raises(UserError, match="the model holds at most 2,048 positions"):
        plan._check_draft_budget(_settings(2048, "needle"), task, shape, draft_evicts=True)


def test_swap_space_up_to_the_host_memory_is_accepted(monkeypatch):
    monkeypatch.setattr(plan, "machine_memory_bytes", lambda device: 1 << 30)
    plan._check_swap_space(SimpleNamespace(swap_bytes=None))
    plan._check_swap_space(SimpleNamespace(swap_bytes=1 << 30))
    with pytest.raises(UserError, match=r"invalid runtime.swap_bytes=1073741825: .*expected at most 1073741824"):
        plan._check_swap_space(SimpleNamespace(swap_bytes=(1 << 30) + 1))


def test_a_method_that_reindexes_positions_runs_past_the_models_positions_and_others_do_not():
    """StreamingLLM with position_mode=reindex keeps its positions inside the cache (the engine exempts it), so a
    perplexity window past the model's 8,192 positions is its use case; the same window without it is refused."""
    from tests.harness_fakes import compose

    args = ["task.max_tokens=9000", "budget=64", "task.chunk_size=64", "logger.wandb=false"]
    reindexed = plan.plan_run(compose([*args, "method=streaming_llm", "method.position_mode=reindex"]))
    assert reindexed.task.options.max_tokens == 9000
    with pytest.raises(UserError, match="invalid task.max_tokens=9000: a window past the model's 8192 positions"):
        plan.plan_run(compose([*args, "method=streaming_llm"]))
    shape = SimpleNamespace(max_positions=8192)
    assert plan._positions_as_run(shape, SimpleNamespace(rope_mode="original")) is shape
    assert plan._positions_as_run(None, SimpleNamespace(rope_mode="reindex")) is None

"""Thread policy: kvbench sets a short OpenMP spin before torch loads libgomp, leaves a user's own setting alone,
and says when torch was imported first."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from kvbench.runtime.backends.cpu import threads

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROBE = ("import json, os, sys; {first}; from kvbench.runtime.backends.cpu import threads; import torch; "
         "n = threads.configure_threads(2); "
         "print(json.dumps([os.environ.get('GOMP_SPINCOUNT'), threads.policy_in_effect(), n, "
         "torch.get_num_threads()]))")


def probe(first: str, **env_extra: str) -> list:
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    env.update(env_extra)
    out = subprocess.run([sys.executable, "-c", PROBE.format(first=first)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


def test_kvbench_first_sets_the_policy_and_torch_first_warns():
    (spin, in_effect, n, torch_n), err = probe("import kvbench")
    assert spin == threads.SPIN_COUNT and in_effect and n == torch_n == 2 and "spin-wait" not in err
    (spin, in_effect, n, _), err = probe("import torch; import kvbench")
    assert not in_effect and "torch was imported before kvbench" in err


def test_a_users_own_setting_is_kept(monkeypatch):
    monkeypatch.setattr(threads, "_state", {"applied": False, "torch_was_loaded": False, "warned": False})
    monkeypatch.setenv("GOMP_SPINCOUNT", "5")
    assert threads.apply_wait_policy() is False and os.environ["GOMP_SPINCOUNT"] == "5"
    assert threads.policy_in_effect()


def test_configure_threads_default_is_bounded_by_the_usable_cores():
    before = torch.get_num_threads()
    try:
        assert threads.configure_threads(1) == 1 == torch.get_num_threads()
        n = threads.configure_threads(None)
        assert 1 <= n <= threads.usable_cores() and n == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


class FakeRuntime:
    """A clock and a thread setting where a step's time depends on the thread count through `cost`."""

    def __init__(self, configured=2):
        self.threads, self.t, self.cost = configured, 0.0, {1: 1.0, 2: 0.8}

    def step(self, ctl, tokens=1):
        n = ctl.begin(tokens)
        assert self.threads == n
        self.t += self.cost[n] if tokens <= ctl.max_tokens else 5.0
        ctl.end()
        assert self.threads == 2  # the configured count is back after every step
        return n


def controller(rt):
    return threads.StepThreads(clock=lambda: rt.t, get_threads=lambda: rt.threads,
                               set_threads=lambda n: setattr(rt, "threads", n))


def test_step_threads_follow_the_faster_count_as_load_comes_and_goes():
    rt = FakeRuntime()
    ctl = controller(rt)
    idle = [rt.step(ctl) for _ in range(100)]
    assert idle[-50:].count(2) >= 45  # idle: two threads are faster, one is only tried now and then
    rt.cost = {1: 1.0, 2: 3.0}  # a competing process: two threads collapse
    loaded = [rt.step(ctl) for _ in range(300)]
    assert loaded[-100:].count(1) >= 95
    rt.cost = {1: 1.0, 2: 0.8}  # the other process ended
    again = [rt.step(ctl) for _ in range(600)]
    assert again[-100:].count(2) >= 95


def test_large_steps_use_every_thread():
    rt = FakeRuntime()
    ctl = controller(rt)
    rt.cost = {1: 1.0, 2: 3.0}
    for _ in range(50):
        rt.step(ctl)
    assert rt.step(ctl, tokens=512) == 2


def test_an_idle_machine_pays_for_few_explorations_and_load_is_caught_within_three_steps():
    rt = FakeRuntime()
    ctl = controller(rt)
    first = [rt.step(ctl) for _ in range(32)]
    assert first.count(1) <= 2  # a 32-token generation: the second step, and step 16
    for _ in range(200):
        rt.step(ctl)
    rt.cost = {1: 1.0, 2: 3.0}  # a competing process arrives mid-generation
    after = [rt.step(ctl) for _ in range(5)]
    assert after == [2, 2, 1, 1, 1]  # two slow steps, then one thread is tried and kept


def test_a_slow_step_that_is_not_load_does_not_switch():
    rt = FakeRuntime()
    ctl = controller(rt)
    for _ in range(40):
        rt.step(ctl)
    rt.cost = {1: 1.0, 2: 5.0}  # one disturbed step (a page fault storm, say)
    rt.step(ctl)
    rt.cost = {1: 1.0, 2: 0.8}
    steps = [rt.step(ctl) for _ in range(30)]
    assert steps.count(1) <= 1  # no switch (a switch would hold one thread for 16 steps): at most the periodic try

"""Issue 67, item 4: a threshold method's realized compression (kv_kept_fraction) is recorded on every task,
perplexity included: the app adds the method's prefill_stats where the task did not."""
from __future__ import annotations

import dataclasses

from kvbench.run import app
from tests.harness_fakes import FakeEngine, FakeMethod, compose, fake_loader


@dataclasses.dataclass
class KeepingMethod(FakeMethod):
    kept: tuple = (0.25, 100.0)  # (fraction, prompt tokens mean); fraction None: nothing compressed

    def prefill_stats(self) -> dict:
        fraction, prompt = self.kept
        return {"kv_tokens_kept_mean": None if fraction is None else fraction * prompt,
                "prompt_tokens_mean": prompt if fraction is not None else None, "kv_kept_fraction": fraction}


def run(tmp_path, kept):
    cfg = compose([f"results_dir={tmp_path}", "logger.wandb=false", "task.max_tokens=40", "task.chunk_size=4", "method=dms",
                   "method.threshold=-3"])
    return app.run(cfg, load_model_fn=fake_loader(), engine_cls=FakeEngine,
                   build_method_fn=lambda name, budget=None, **kw: KeepingMethod(budget=budget, name=name, kept=kept))


def test_perplexity_records_what_a_threshold_method_kept(tmp_path):
    rec = run(tmp_path / "a", (0.25, 100.0))
    assert rec["status"] == "ok" and rec["task"] == "perplexity"
    assert rec["kv_kept_fraction"] == 0.25 and rec["kv_tokens_kept_mean"] == 25.0


def test_nothing_compressed_records_no_fraction(tmp_path):
    rec = run(tmp_path / "b", (None, 100.0))
    assert rec["status"] == "ok" and "kv_kept_fraction" not in rec

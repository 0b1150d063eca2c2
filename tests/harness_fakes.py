"""Small fakes for the harness tests: a char-level tokenizer, a deterministic engine, a loader and a method."""
from __future__ import annotations

import copy
import dataclasses
import functools
import math
import os
from types import SimpleNamespace
from typing import Any, Callable, Optional, Sequence

import torch

CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")
# One converted-model cache for every test (and for `make`): converting the GGUF takes ~20 s, loading ~2 s.
os.environ.setdefault("KVBENCH_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "kvbench"))


class CharTokenizer:
    """Token id = code point; with bos, id 1 comes first (like a tokenizer adding a BOS by default)."""

    def __init__(self, bos: bool = False):
        self.bos = bos

    def __call__(self, text: str) -> dict:
        ids = [ord(c) for c in text]
        return {"input_ids": ([1] if self.bos else []) + ids}


def fake_logprob(prev: int, nxt: int) -> float:
    return -(1.0 + (prev * 31 + nxt) % 5) / 2.0


class FakeEngine:
    """score(): deterministic log-probs from the token pair; memory figures that look like a real pool."""

    instances: list = []

    def __init__(self, model: Any, method: Any, **kwargs: Any):
        self.model, self.method, self.kwargs = model, method, kwargs
        self.scored: list[list[int]] = []
        self.fail: Optional[BaseException] = getattr(model, "fail", None)
        self.attention_backend = "fake"
        FakeEngine.instances.append(self)

    def score(self, token_ids: Sequence[int], chunk_size: Optional[int] = None,
              progress: Optional[Callable[[int], None]] = None) -> torch.Tensor:
        if self.fail is not None:
            raise self.fail
        ids = list(token_ids)
        self.scored.append(ids)
        chunk = chunk_size or self.kwargs.get("prefill_chunk_size", 512)
        for a in range(0, len(ids), chunk):
            if progress is not None:
                progress(min(chunk, len(ids) - a))
        return torch.tensor([fake_logprob(a, b) for a, b in zip(ids[:-1], ids[1:])], dtype=torch.float32)

    def memory_stats(self) -> dict:
        n = max((len(s) for s in self.scored), default=0)
        return {"peak_kv_bytes": 100 * n, "full_kv_bytes": 200 * n, "held_kv_bytes": 100 * n,
                "fork_shared_kv_bytes": 0, "kv_pool_bytes": 400 * n, "kv_bytes_per_token": 200.0,
                "block_size": 16, "num_blocks": 8}


def expected_ppl(ids: Sequence[int]) -> float:
    lps = [fake_logprob(a, b) for a, b in zip(ids[:-1], ids[1:])]
    return math.exp(-sum(lps) / len(lps))


def fake_loader(fail: Optional[BaseException] = None, bos: bool = False) -> Callable:
    def load(path, *, gguf_file=None, dtype="float32", device="cpu", cache_dir=None):
        return SimpleNamespace(model=SimpleNamespace(fail=fail), tokenizer=CharTokenizer(bos=bos),
                               hf_config=None, name=path or "fake-model", dtype=torch.float32, device=device)

    return load


@dataclasses.dataclass
class FakeMethod:
    budget: Optional[int] = None
    window: int = 4
    name: str = "fake"
    options: dict = dataclasses.field(default_factory=dict)  # any other option of the real method's YAML

    def describe(self) -> dict:
        return {"budget": self.budget, "window": self.window, **self.options}


def fake_build_method(name: str, budget: Optional[int] = None, **options: Any) -> FakeMethod:
    window = options.pop("window", 4)
    return FakeMethod(budget=budget, name=name, window=window, options=options)


def compose(overrides: Sequence[str] = ()) -> Any:
    """The run config as `python -m kvbench <overrides>` would compose it (hydra node left out); each call gets its
    own copy. A command line is composed once per test process (conf/ does not change while the tests run: a Hydra
    compose takes ~0.2 s, a copy ~4 ms), except one naming a hydra.* setting (a search path over a test's folder)."""
    if any(o.lstrip("+~").startswith("hydra") for o in overrides):
        return _hydra_compose(tuple(overrides))
    return copy.deepcopy(_composed_once(tuple(overrides)))


def _hydra_compose(overrides: tuple) -> Any:
    import kvbench.run.config  # noqa: F401  (registers the schemas first)
    from hydra import compose as hydra_compose, initialize_config_dir

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return hydra_compose(config_name="config", overrides=list(overrides))


_composed_once = functools.lru_cache(maxsize=256)(_hydra_compose)


# --------------------------------------------------------------------------- `python -m tests.harness_fakes ARGS`
# The real CLI (Hydra, launchers, signals, the results store, exit codes) over the fakes above: no model is loaded,
# so a subprocess run costs the interpreter start only. The fault tests kill, interrupt and race these.
FAKES = dict(load_model_fn=fake_loader(), engine_cls=FakeEngine, build_method_fn=fake_build_method)


REPO = os.path.dirname(CONF_DIR)
FAKE_ARGS = ("logger.wandb=false", "task.max_tokens=40", "task.chunk_size=4", "method=h2o")


def fake_env(**extra: str) -> dict:
    """Environment of a fake-CLI subprocess: this checkout first on sys.path, no W&B, no Hydra tracebacks."""
    import sys as _sys  # noqa: F401

    env = dict(os.environ, PYTHONUNBUFFERED="1", **extra)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    for key in ("HYDRA_FULL_ERROR", "WANDB_API_KEY", "WANDB_MODE", "KVBENCH_TEST_SLEEP_S", "KVBENCH_TEST_MARKER",
                "KVBENCH_TEST_CRASH_BEFORE_INDEX"):
        if key not in extra:
            env.pop(key, None)
    return env


def start_fake(*args: str, cwd: Any, **env_extra: str) -> Any:
    """Popen of `python -m tests.harness_fakes FAKE_ARGS ARGS` (stdout/stderr captured as text)."""
    import subprocess
    import sys

    flags = [a for a in args if a.startswith("-")]  # Hydra's flags (-m) before the overrides
    overrides = [a for a in args if not a.startswith("-")]
    return subprocess.Popen([sys.executable, "-m", "tests.harness_fakes", *flags, *FAKE_ARGS, *overrides],
                            cwd=str(cwd),
                            env=fake_env(**env_extra), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run_fake_cli(*args: str, cwd: Any, timeout: float = 120, **env_extra: str) -> Any:
    """Run the fake CLI to the end: a CompletedProcess-like object with returncode, stdout, stderr."""
    proc = start_fake(*args, cwd=cwd, **env_extra)
    out, err = proc.communicate(timeout=timeout)
    return SimpleNamespace(returncode=proc.returncode, stdout=out, stderr=err)


def wait_for_lines(path: Any, n: int, proc: Any, timeout: float = 300) -> None:
    """Wait until the test marker file has n lines (n runs reached their sleep), or fail. The process ending
    early fails at once; the timeout is only a safety net (a loaded machine starts a CLI in tens of seconds)."""
    import time

    t0 = time.time()
    while time.time() - t0 < timeout:
        if os.path.exists(path) and len(open(path).read().splitlines()) >= n:
            return
        if proc.poll() is not None:
            raise AssertionError(f"process ended early: {proc.communicate()}")
        time.sleep(0.05)
    raise AssertionError("the run never reached its sleep")


def _fake_task_function(cfg: Any) -> Any:
    from kvbench.commands import hydra_task

    return hydra_task.main(cfg, **FAKES)


def fake_cli() -> None:
    import hydra

    import kvbench.run.config  # noqa: F401
    from kvbench.commands.cli import run_app_cli

    main = hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")(_fake_task_function)
    run_app_cli(main)


if __name__ == "__main__":
    fake_cli()

"""Config composition through Hydra's compose API, schemas, validation and run ids (bad values, one line and exit 2:
tests/app/test_bad_input.py)."""
from __future__ import annotations

import glob
import os

import pytest
from omegaconf import OmegaConf

import kvbench.run.config as kconfig
from kvbench.run import spec
from tests.harness_fakes import CONF_DIR, compose
from kvbench.errors import UserError
from kvbench.registry import METHODS
from kvbench.store.naming import run_id_for


def _choices(group: str) -> list[str]:
    return sorted(os.path.splitext(os.path.basename(p))[0] for p in glob.glob(os.path.join(CONF_DIR, group, "*.yaml")))


def test_default_config():
    cfg = compose()
    assert cfg.budget is None and cfg.seed == 0 and cfg.results_dir == "results" and cfg.rerun is False
    assert cfg.model.name == "smollm2-135m" and cfg.model.path is None and cfg.model.dtype == "float32"
    assert cfg.method.name == "full"
    assert cfg.task.name == "perplexity" and cfg.task.corpus == "pg_essays" and cfg.task.max_tokens == 4096
    assert cfg.task.chunk_size == 256
    rt = cfg.runtime
    assert (rt.block_size, rt.num_blocks, rt.kv_memory_bytes, rt.prefill_chunk_size, rt.batch_size,
            rt.attention_backend, rt.threads) == (16, None, None, 512, 1, "auto", None)
    assert cfg.logger.wandb is True and cfg.logger.project == "kvbench" and cfg.logger.mode == "auto"
    s = kconfig.validate(cfg)
    assert s.method_name == "full" and s.task_name == "perplexity" and s.budget is None
    assert os.path.isabs(s.results_dir)


def test_overrides_and_types():
    cfg = compose(["method=full", "budget=1024", "seed=3", "runtime.block_size=32", "task.max_tokens=64"])
    assert cfg.budget == 1024 and cfg.seed == 3 and cfg.runtime.block_size == 32 and cfg.task.max_tokens == 64


def test_hf_model_names_itself():
    s = kconfig.validate(compose(["model=hf", "model.path=/some/where/My-Model"]))
    assert s.model.name == "My-Model" and s.model.path == "/some/where/My-Model"


@pytest.mark.parametrize("group", ["model", "method", "task", "runtime", "logger"])
def test_every_group_option_composes(group):
    for option in _choices(group):
        overrides = [f"{group}={option}"] + (["model.path=x"] if option == "hf" else [])
        if group == "method" and option in METHODS and getattr(METHODS[option], "reads_question", False):
            overrides += ["task=ruler", "task.compress_question=true"]  # finch: a task that says the question
        cfg = compose(overrides)
        if group in ("method", "task"):
            assert cfg[group].name, f"conf/{group}/{option}.yaml needs a name"
        kconfig.validate(cfg)


def test_the_tests_compose_is_hydras_and_each_call_gets_its_own_copy():
    """tests.harness_fakes.compose composes a command line once per process: the same config as Hydra's compose,
    and a caller changing its copy changes no other caller's."""
    from tests.harness_fakes import _hydra_compose

    args = ["method=snapkv", "budget=64"]
    a, b = compose(args), compose(args)
    assert a is not b and a == b == _hydra_compose(tuple(args))
    a.budget, a.method.window = 7, 3
    assert compose(args) == b and b.budget == 64 and b.method.window != 3
    searched = ["hydra.searchpath=[]", "budget=64"]  # a hydra.* setting: composed each time
    assert compose(searched) is not compose(searched) and compose(searched).budget == 64


def test_schemas_are_not_choices():
    # the dataclass schemas are stored at the root of the ConfigStore, not in the groups
    assert "kvbench_schema" not in _choices("model")
    from hydra.core.config_store import ConfigStore

    repo = ConfigStore.instance().repo
    assert "kvbench_schema.yaml" in repo
    for group in ("model", "method", "task", "runtime", "logger"):
        assert group not in repo, f"a schema stored in group {group!r} would show up as a choice"


def test_run_id_is_stable_and_ignores_output_settings():
    a = compose(["method=h2o", "budget=256"])
    b = compose(["method=h2o", "budget=256", "results_dir=/elsewhere", "logger.wandb=false", "rerun=true",
                 "model.cache_dir=/tmp/x", "runtime.threads=3"])
    c = compose(["method=h2o", "budget=512"])
    d = compose(["method=h2o", "budget=256", "seed=1"])
    ids = [run_id_for(kconfig.hashable_config(x)) for x in (a, b, c, d)]
    assert ids[0] == ids[1]
    assert len(set(ids[0:1] + ids[2:])) == 3
    assert ids[0].startswith("smollm2-135m_perplexity_h2o_b256_s0_")


def test_hydra_run_dir_is_the_run_folder(tmp_path):
    import kvbench.run.config  # noqa: F401
    from hydra import compose as hcompose, initialize_config_dir

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = hcompose(config_name="config", overrides=[f"results_dir={tmp_path}", "budget=8"],
                       return_hydra_config=True)
    run_dir = cfg.hydra.run.dir
    assert os.path.dirname(run_dir) == str(tmp_path)
    assert os.path.basename(run_dir) == run_id_for(kconfig.hashable_config(cfg))
    assert cfg.hydra.sweep.dir == str(tmp_path)
    assert cfg.hydra.job.name == "kvbench" and cfg.hydra.job.chdir is False


def test_validate_accepts_plain_dicts():
    cfg = OmegaConf.create({"model": {"name": "m"}, "method": {"name": "h2o", "window": 3},
                            "task": {"name": "perplexity"}, "budget": 7})
    s = kconfig.validate(cfg)
    assert s.method_options == {"window": 3} and s.budget == 7 and s.model.name == "m"
    with pytest.raises(UserError, match="unknown option runtime.blocks"):
        kconfig.validate(OmegaConf.create({"method": {"name": "full"}, "task": {"name": "perplexity"},
                                           "runtime": {"blocks": 3}}))


def test_task_options_are_checked_by_the_task_not_a_schema():
    # config.py imports no task: task values are checked when the app builds the task
    import subprocess
    import sys

    code = "import sys, kvbench.run.config; sys.exit(any(m == 'kvbench.tasks' or m.startswith('kvbench.tasks.') for m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
    from kvbench.tasks import build_task

    s = kconfig.validate(compose(["task.max_tokens=many"]))
    with pytest.raises(UserError, match="invalid task.max_tokens='many'"):
        build_task(s.task_name, s.task_options)


def test_codec_shorthand_budget_null_and_threads_share_one_run_id():
    def rid(*o):
        return run_id_for(kconfig.hashable_config(compose(list(o))))

    assert rid("method=kivi") == rid("method=full", "quant=kivi")
    assert rid("method=full", "budget=128") == rid("method=full", "budget=256") == rid("method=full")
    assert rid("method=kivi", "budget=64") == rid("method=kivi")
    assert rid("method=h2o", "budget=64") != rid("method=h2o", "budget=128")
    assert rid("runtime.threads=1") == rid("runtime.threads=4") == rid()
    assert rid("runtime.block_size=32") != rid()
    s = kconfig.validate(compose(["method=kivi", "budget=64"]))
    assert (s.method_name, s.quant_name, s.budget) == ("full", "kivi", None) and s.quant_options["bits"] == 2


def test_kivi_runs_keep_the_ids_they_had_before_quant_rotate():
    """quant.rotate (added later) at its default is left out of the hash: a KIVI run's identity holds no trace of
    the option (so a stored run keeps its folder), and spelling the defaults out is the same run. (Ids were pinned
    here once; the model-files digest added to every run's identity since moved them all.)"""
    def rid(*o):
        return run_id_for(kconfig.hashable_config(compose(list(o))))

    for config in (["quant=kivi"], ["method=snapkv", "budget=64", "quant=kivi", "quant.bits=4"]):
        assert "rotate" not in repr(kconfig.hashable_config(compose(config)))
        assert rid(*config) == rid(*config, "quant.rotate=none", "quant.rotate_seed=0")
    assert rid("quant=kivi", "quant.rotate=hadamard") != rid("quant=kivi")  # a rotation is another run
    assert rid("quant=mxfp4", "quant.rotate=hadamard") != rid("quant=mxfp4", "quant.rotate=hadamard",
                                                               "quant.rotate_seed=1")


def test_run_folder_is_named_after_the_model_path():
    assert run_id_for(kconfig.hashable_config(compose(["model.path=/models/Llama-3.2-1B"]))).startswith(
        "Llama-3.2-1B_perplexity_full_")
    assert run_id_for(kconfig.hashable_config(compose(["model=hf", "model.path=org/Qwen2.5-0.5B"]))).startswith(
        "Qwen2.5-0.5B_")
    assert kconfig.validate(compose(["model.path=/models/Llama-3.2-1B"])).model.name == "Llama-3.2-1B"


def test_integral_floats_are_one_setting():
    """`quant.group_size=32.0` is `quant.group_size=32` (one run id, an int for the codec); a codec's float option
    stays a float (`outlier_fraction=0` is `0.0`); task and method options alike."""
    def rid(*o):
        return run_id_for(kconfig.hashable_config(compose(list(o))))

    assert rid("quant=kivi", "quant.group_size=32.0") == rid("quant=kivi", "quant.group_size=32") == rid("quant=kivi")
    assert rid("method=kivi", "method.bits=4.0") == rid("quant=kivi", "quant.bits=4")
    assert rid("quant=kivi", "quant.group_size=64.0") != rid("quant=kivi")
    assert rid("quant=kvquant", "quant.outlier_fraction=0") == rid("quant=kvquant", "quant.outlier_fraction=0.0")
    assert rid("task.max_tokens=1024.0") == rid("task.max_tokens=1024")
    assert rid("method=h2o", "budget=64", "method.recent_ratio=1.0") == rid("method=h2o", "budget=64",
                                                                            "method.recent_ratio=1")
    s = kconfig.validate(compose(["quant=kvquant", "quant.bits=3.0", "quant.outlier_fraction=0", "task=needle",
                                  "task.lengths=[512.0,1024]"]))
    assert s.quant_options["bits"] == 3 and type(s.quant_options["bits"]) is int
    assert type(s.quant_options["outlier_fraction"]) is float
    assert s.task_options["lengths"] == [512, 1024] and all(type(n) is int for n in s.task_options["lengths"])
    # beyond 2**53 a float is not an exact integer: left as written (and refused where an integer is expected)
    assert spec.normalise_numbers({"seed": 1e21}) == {"seed": 1e21}


def test_bits_3_0_builds_the_codec_it_names():
    # quant.bits=3.0 used to calibrate, then fail on `1 << bits`: normalised, it checks and builds as 3
    from kvbench.quant.registry import check_codec

    s = kconfig.validate(compose(["quant=kvquant", "quant.bits=3.0", "quant.levels=uniform",
                                  "quant.key_ranges=online"]))
    check_codec(s.quant_name, s.quant_options)
    from kvbench.quant.registry import build_codec

    codec = build_codec(s.quant_name, None, **s.quant_options)
    assert codec.bits == 3 and type(codec.bits) is int


def test_an_unresolvable_interpolation_still_names_a_run_folder():
    cfg = compose(["budget=${oc.env:KVBENCH_NO_SUCH_VAR}"])
    kconfig.hashable_config(cfg)  # never raises (names the run folder Hydra makes before validate refuses it)


def test_results_dir_tilde_is_expanded_once_for_every_consumer(tmp_path, monkeypatch):
    from hydra import compose as hcompose, initialize_config_dir

    monkeypatch.setenv("HOME", str(tmp_path))
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = hcompose(config_name="config", overrides=['results_dir="~/res"'], return_hydra_config=True)
    home_res = str(tmp_path / "res")
    assert kconfig.results_path("~/res") == home_res
    assert cfg.hydra.sweep.dir == home_res  # -m: the run folders
    assert os.path.dirname(cfg.hydra.run.dir) == home_res  # a single run's folder
    assert kconfig.validate(cfg).results_dir == home_res  # runs.jsonl


def test_tilde_results_dir_in_a_sweep_keeps_runs_and_index_together(tmp_path):
    # `-m` used to write run folders to ./~/res but runs.jsonl to $HOME/res
    from tests.harness_fakes import run_fake_cli

    home = tmp_path / "home"
    home.mkdir()
    proc = run_fake_cli("-m", "budget=8,16", 'results_dir="~/res"', cwd=tmp_path, HOME=str(home))
    assert proc.returncode == 0, proc.stderr
    assert not (tmp_path / "~").exists()
    res = home / "res"
    runs = [p for p in res.iterdir() if (p / "metrics.json").is_file()]
    assert len(runs) == 2 and (res / "runs.jsonl").is_file()
    assert len((res / "runs.jsonl").read_text().splitlines()) == 2


# issue 37: two spellings of one setting are one run (one run id) and the task sees one form
SAME_RUN = [
    (["runtime.prefix_caching=1"], ["runtime.prefix_caching=true"]),
    (["task=throughput", "task.request_rate=.inf"], ["task=throughput", "task.request_rate=inf"]),
    (["task=throughput", "task.request_rate=.inf"], ["task=throughput"]),
    (["task=throughput", "task.input_tokens=[512,512]"], ["task=throughput", "task.input_tokens=512"]),
    (["task=ruler", "task.lengths=[1024,1024]"], ["task=ruler", "task.lengths=[1024]"]),
    (["task=ruler", "task.lengths=1024"], ["task=ruler", "task.lengths=[1024]"]),
    (["quant=kivi", "quant.rotate=none", "quant.rotate_seed=0"], ["quant=kivi"]),
]
OTHER_RUN = [
    (["runtime.prefix_caching=false"], ["runtime.prefix_caching=true"]),
    (["task=throughput", "task.input_tokens=[512,1024]"], ["task=throughput", "task.input_tokens=512"]),
    (["task=ruler", "task.lengths=[1024,2048]"], ["task=ruler", "task.lengths=[1024]"]),
]


@pytest.mark.parametrize("a,b", SAME_RUN + OTHER_RUN, ids=[" vs ".join(" ".join(x) for x in p) for p in SAME_RUN + OTHER_RUN])
def test_one_spelling_one_run_id(a, b):
    same = (a, b) in SAME_RUN
    ca, cb = compose(a), compose(b)
    assert (run_id_for(kconfig.hashable_config(ca)) == run_id_for(kconfig.hashable_config(cb))) is same
    sa, sb = kconfig.validate(ca), kconfig.validate(cb)
    assert ((sa.task_options, sa.runtime) == (sb.task_options, sb.runtime)) is same


def test_run_folder_names_keep_the_configured_names_and_the_ratio():
    def name(*overrides):
        return run_id_for(kconfig.hashable_config(compose(list(overrides))))

    assert name("method=paged_eviction", "quant=kivi", "budget=256").startswith(
        "smollm2-135m_perplexity_paged_eviction-kivi_b256_s0_")
    assert name("method=kivi").startswith("smollm2-135m_perplexity_full-kivi_bnone_s0_")
    ratios = [name("method=snapkv", f"compression_ratio={r}") for r in (0.25, 0.5)]
    assert ratios[0].startswith("smollm2-135m_perplexity_snapkv_r0.25_s0_") and "_r0.5_" in ratios[1]
    assert all(set(n) <= set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-") for n in ratios)

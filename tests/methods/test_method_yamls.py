"""Each method's YAML against its dataclass (issue 71, item 2): every registered method has conf/method/<name>.yaml;
every key a method YAML sets is an option of its method's dataclass (inherited ones included), and a method's own
YAML gives each option it lists the dataclass's default (the registry rows composed on it, such as
decoding_knorm, set options of their own)."""
from __future__ import annotations

import dataclasses
import os

import pytest
from omegaconf import OmegaConf

from kvbench.methods import METHODS
from kvbench.run.spec import codec_names
from tests.harness_fakes import CONF_DIR, compose

METHOD_DIR = os.path.join(CONF_DIR, "method")
YAMLS = sorted(f[:-5] for f in os.listdir(METHOD_DIR) if f.endswith(".yaml"))


def options_of(cls: type) -> dict:
    """The options a method's YAML may set: its dataclass's init fields (budget and compression_ratio are
    top-level knobs) with their defaults."""
    out = {}
    for f in dataclasses.fields(cls):
        if f.init and f.name not in ("budget", "compression_ratio"):
            out[f.name] = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    return out


def composed_method(stem: str) -> dict:
    return OmegaConf.to_container(compose([f"method={stem}"]).method, resolve=True)


def test_every_registered_method_has_its_yaml():
    missing = [f"conf/method/{n}.yaml (method {n!r}, {METHODS.source_file(n)})" for n in METHODS.names()
               if n not in YAMLS]
    assert not missing, "a registered method's YAML is missing: " + "; ".join(missing)


@pytest.mark.parametrize("stem", YAMLS)
def test_yaml_keys_are_options_of_the_dataclass(stem):
    section = composed_method(stem)
    name = section.pop("name")
    if name in codec_names() and name not in METHODS:
        pytest.skip("a codec's shorthand (method=kivi = method=full quant=kivi): tests/quant/test_codec_methods.py")
    options = options_of(METHODS[name])
    unknown = sorted(set(section) - set(options))
    assert not unknown, f"conf/method/{stem}.yaml sets {unknown}: not options of {name!r} ({sorted(options)})"
    if stem == name:  # the method's own YAML: its defaults are the dataclass's
        differ = {k: (v, options[k]) for k, v in section.items() if v != options[k]}
        assert not differ, f"conf/method/{stem}.yaml's defaults differ from the dataclass's (yaml, dataclass): {differ}"


def test_a_yaml_holding_only_name_takes_the_inherited_options(tmp_path):
    """`method.decode=evict` on a YAML holding only `name:` was Hydra's "unknown option"; the options are the
    dataclass's (inherited ones included), and an unknown one is refused by the method, naming the valid ones."""
    from kvbench.errors import UserError
    from kvbench.run.plan import plan_run

    (tmp_path / "method").mkdir()
    (tmp_path / "method" / "only_name.yaml").write_text("name: knorm\n")
    args = [f"hydra.searchpath=[file://{tmp_path}]", "method=only_name", "budget=16", "logger.wandb=false"]
    cfg = compose([*args, "method.decode=interval", "method.interval=8", "method.prefill_mode=streaming"])
    method = plan_run(cfg).method
    assert (method.name, method.decode, method.interval, method.prefill_mode) == ("knorm", "interval", 8, "streaming")
    with pytest.raises(UserError, match="unknown option method.intervall for method 'knorm'.*did you mean interval"):
        plan_run(compose([*args, "method.intervall=8"]))

"""The method protocol is declared once (kvbench.runtime.hooks.NoCompression: every member with its default) and read
as plain attributes everywhere else: no getattr / hasattr probe of a method member outside the contract modules.
The scan is a real judge (it finds a probe planted in a copy of a module), the protocol's defaults are what the
runtime used to assume, and an object that does not subclass NoCompression gets them through `declared`."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from kvbench.methods import METHODS, build_method
from kvbench.runtime.hooks import NoCompression, declared

ROOT = Path(__file__).resolve().parents[2]
# kvbench/ and the top-level methods/ and tasks/ that kvbench/methods and kvbench/tasks link to
SOURCES = ("kvbench", "methods", "tasks")
# where members are declared (and the one adapter probes them): the runtime's protocol and the method base class
CONTRACT_MODULES = {"kvbench/runtime/hooks.py", "methods/base.py"}
PROTOCOL = frozenset(n for n in vars(NoCompression) if not n.startswith("_"))
# names also common on other objects (a codec's name, a task's preflight): a probe of these counts only on a
# method-looking receiver
GENERIC = {"name", "preflight"}
# a receiver that is a method: `method`, `self.method`, `engine.method`, a hook, a wrapper's method underneath
# (`self.inner`; a codec's bare `inner` is a codec), a speculative draft method, a class from the method registry
METHOD_RECEIVER = re.compile(r"(^|\.)(method|hook|layer_hook|draft)$|^self\.inner$|^METHODS\b")
# a cache keeps its own copy of the method's page_retrieval (a calibration's capturing cache has none)
CACHE_RECEIVER = re.compile(r"(^|\.)cache$")


def probes(source: str) -> list[tuple[int, str]]:
    """(line, text) of each getattr / hasattr call on a method object or of a protocol member in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2):
            continue
        receiver, member = ast.unparse(node.args[0]), node.args[1]
        named = isinstance(member, ast.Constant) and isinstance(member.value, str)
        if ((named and member.value in PROTOCOL - GENERIC and not CACHE_RECEIVER.search(receiver))
                or METHOD_RECEIVER.search(receiver)):
            found.append((node.lineno, ast.unparse(node)))
    return found


def source_files() -> list[Path]:
    return sorted(p for top in SOURCES for p in (ROOT / top).rglob("*.py")
                  if not p.is_symlink() and "kvbench/methods/" not in p.as_posix().replace(str(ROOT), "")
                  and "kvbench/tasks/" not in p.as_posix().replace(str(ROOT), ""))


def test_no_probe_of_a_method_member_outside_the_contract_modules():
    files = source_files()
    assert any(p.as_posix().endswith("runtime/serving/engine.py") for p in files)
    assert any(p.as_posix().endswith("methods/quest.py") for p in files)  # through the top-level folder
    found = [f"{p.relative_to(ROOT)}:{line}: {text}" for p in files
             if p.relative_to(ROOT).as_posix() not in CONTRACT_MODULES
             for line, text in probes(p.read_text())]
    assert not found, "probes of method members (declare the member on NoCompression, read it plainly):\n" + \
        "\n".join(found)


@pytest.mark.parametrize("planted", [
    'x = getattr(self.method, "acts_after_attention", True)',  # the engine's old probe
    'f = getattr(engine.method, "on_rollback", None)',
    'ok = hasattr(hook, "decode_overshoot")',
    'n = getattr(method, "name", "?")',  # a generic name, on a method
    'r = getattr(METHODS.get(name), "retrieves", False)',
    'w = getattr(thing, "reads_hidden_states", False)',  # a protocol member, on anything
])
def test_the_scan_finds_a_planted_probe(planted):
    engine = (ROOT / "kvbench/runtime/serving/engine.py").read_text()
    assert probes(engine) == []
    assert len(probes(engine + "\n\n" + planted + "\n")) == 1


def test_other_probes_pass():
    assert probes('n = getattr(codec, "name", None)\nb = getattr(cfg, "head_dim", None)\n'
                  'm = getattr(engine, "method", None)\nr = getattr(self.cache, "page_retrieval", None)\n') == []


def test_protocol_defaults_are_what_the_runtime_assumed():
    m = NoCompression()
    assert (m.needs_key_scores, m.acts_after_attention, m.acts_before_attention, m.decode_reads_attention,
            m.reads_hidden_states, m.store_pre_rope, m.rope_mode, m.page_retrieval) == (
        False, False, False, True, False, False, "original", None)
    assert m.pruned_key_channels(64) == 0 and m.decode_overshoot() == 0 and m.prompt_kept_fraction(0) is None
    assert m.prefill_totals() is None and m.prefill_stats() == {} and m.tensor_parallel_refusal() is None
    assert (m.evicts, m.retrieves, m.needs_budget) == (False, False, True)


def test_every_registered_method_has_the_whole_protocol():
    for name in METHODS.names():
        cls = METHODS.get(name)
        assert issubclass(cls, NoCompression), name
        missing = [member for member in PROTOCOL if not hasattr(cls, member)]
        assert not missing, (name, missing)


def test_an_object_outside_the_class_gets_the_defaults():
    class Recorder:  # a hook by its after_attention alone (the runtime tests' recorders)
        needs_key_scores = True

        def after_attention(self, ctx):
            pass

    r = Recorder()
    d = declared(r)
    assert d.needs_key_scores is True and d.acts_after_attention is True  # called: it is a hook
    assert d.decode_reads_attention is True and d.page_retrieval is None and d.pruned_key_channels(64) == 0
    d.attach("cache", "config")  # the default acts on the object itself
    assert r.cache == "cache" and r.model_config == "config"
    with pytest.raises(AttributeError):
        d.not_a_member
    method = build_method("snapkv", 64)
    assert declared(method) is method and isinstance(declared(None), NoCompression)

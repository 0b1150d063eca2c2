"""bench/bench_llamacpp.py's front door: without llama.cpp it skips in one line; a bad argument exits 2 in one line."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_llamacpp.py"


def _run(*args):
    env = dict(os.environ, PYTHONPATH=str(BENCH.parents[1] / "src"))
    return subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, env=env, timeout=120)


def test_skips_in_one_line_without_llamacpp():
    pytest.importorskip("torch")
    try:
        import llama_cpp  # noqa: F401
        pytest.skip("llama_cpp installed here: the bench would run")
    except ImportError:
        pass
    proc = _run()
    assert proc.returncode == 0
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and "skipped" in lines[0] and "--llamacpp-python" in lines[0]


@pytest.mark.parametrize("args, word", [(["--contexts", "512,abc"], "--contexts"),
                                        (["--weights", "q8_0,q3_k"], "--weights"),
                                        (["--weights", ","], "--weights"),
                                        (["--prefill-tokens", "-1"], "--prefill-tokens"),
                                        (["--llamacpp-python", "/nonexistent/python"], "--llamacpp-python")])
def test_bad_input_exits_2_in_one_line(args, word):
    proc = _run(*args)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and word in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    if word == "--weights":  # the valid choices named
        assert all(w in proc.stderr for w in ("f32", "q8_0", "q4_k_m"))


# ---------------------------------------------------------------------------------- the verdicts, both ways
def _bench():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_llamacpp", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


SHAPES = ["prefill2048", "b1_ctx512", "b1_ctx4096", "b1_ctx16384", "b16_ctx512"]
WEIGHTS = ("f32", "q8_0", "q4_k_m")


def _figures():
    figures = {"kvbench_f32_b1_ctx512": 36.0, "kvbench_f32_b1_ctx4096": 29.0, "kvbench_f32_b1_ctx16384": 14.0,
               "kvbench_f32_b16_ctx512": 240.0, "bandwidth_fraction_f32_b1_ctx4096": 0.88}
    for w in WEIGHTS:
        figures.update({f"ratio_{w}_{shape}": 1.1 + 0.05 * i for i, shape in enumerate(SHAPES)})
    return figures


def _checks(figures, weights=WEIGHTS, prefill=2048):
    return _bench().target_checks(figures, [512, 4096, 16384], 512, weights, prefill)


def test_good_figures_pass_and_pass_again():
    first = _checks(_figures())
    assert first == _checks(_figures())
    assert set(first) == {"b16_over_b1_ctx512_ge_6", "bandwidth_fraction_b1_ctx4096_ge_0.85"} | {
        f"ahead_of_llamacpp_{w}_{shape}" for w in WEIGHTS for shape in SHAPES}
    assert all(first.values())


def test_every_weights_type_and_shape_is_judged_even_without_f32():
    """Without F32 there are no issue 47 checks, but each quantized type still has one verdict per shape, prefill
    included; without a prefill shape there is no prefill verdict."""
    checks = _checks(_figures(), ("q8_0", "q4_k_m"))
    assert set(checks) == {f"ahead_of_llamacpp_{w}_{shape}" for w in ("q8_0", "q4_k_m") for shape in SHAPES}
    assert all(checks.values())
    assert not any("prefill" in name for name in _checks(_figures(), ("q8_0",), prefill=0))


@pytest.mark.parametrize("key, bad, check", [
    ("kvbench_f32_b16_ctx512", 210.0, "b16_over_b1_ctx512_ge_6"),  # 5.83x batch 1
    ("kvbench_f32_b16_ctx512", float("nan"), "b16_over_b1_ctx512_ge_6"),
    ("kvbench_f32_b1_ctx512", None, "b16_over_b1_ctx512_ge_6"),
    ("bandwidth_fraction_f32_b1_ctx4096", 0.84, "bandwidth_fraction_b1_ctx4096_ge_0.85"),
    ("bandwidth_fraction_f32_b1_ctx4096", float("nan"), "bandwidth_fraction_b1_ctx4096_ge_0.85"),
    ("ratio_f32_b1_ctx16384", 0.98, "ahead_of_llamacpp_f32_b1_ctx16384"),
    ("ratio_f32_b1_ctx16384", 1.0, "ahead_of_llamacpp_f32_b1_ctx16384"),  # a tie is not ahead
    ("ratio_f32_b16_ctx512", float("nan"), "ahead_of_llamacpp_f32_b16_ctx512"),
    ("ratio_f32_b1_ctx512", "missing", "ahead_of_llamacpp_f32_b1_ctx512"),  # llama.cpp failed: no ratio
    ("ratio_q8_0_prefill2048", 0.4, "ahead_of_llamacpp_q8_0_prefill2048"),
    ("ratio_q4_k_m_b1_ctx4096", 0.7, "ahead_of_llamacpp_q4_k_m_b1_ctx4096"),
    ("ratio_q4_k_m_b16_ctx512", "missing", "ahead_of_llamacpp_q4_k_m_b16_ctx512"),
    ("ratio_q8_0_b1_ctx512", None, "ahead_of_llamacpp_q8_0_b1_ctx512"),
])
def test_a_worse_missing_or_nan_figure_is_not_met(key, bad, check):
    figures = _figures()
    if bad == "missing":
        del figures[key]
    else:
        figures[key] = bad
    checks = _checks(figures)
    assert checks[check] is False
    assert all(ok for name, ok in checks.items() if name != check)


def test_step_bytes_counts_weights_and_the_kv_each_step_reads():
    bench = _bench()
    # decode: each of 16 sequences reads its 512-token context and, on average, half the 32 new tokens
    assert bench.step_bytes(1000, 10, 512, 16, 32) == 1000 + 16 * (512 + 16) * 10
    assert bench.step_bytes(1000, 10, 4096, 1, 32) == 1000 + (4096 + 16) * 10
    assert bench.step_bytes(1000, 10, 0, 1, 32, prefill=2048) == 1000 + 2048 * 10  # the prompt's K/V written


def test_weights_census_counts_the_file_types_and_what_kvbench_holds(tmp_path):
    """A small GGUF in a type with kernels (Q8_0) is held all quantized; one without (Q4_1) is all fp32, and the
    census says how many tensors had no kernel."""
    pytest.importorskip("gguf")
    from kvbench.runtime.backends.cpu.quant_linear import load_quant_kernel
    from kvbench.runtime.model.loading import load_model
    from tests.fixtures.gguf_fixtures import write_gguf
    from tests.tiny_models import tiny_hf_model

    if load_quant_kernel() is None:
        pytest.skip("no C compiler for the kernels")
    hf = tiny_hf_model("tied", seed=3, vocab=320)
    projections = 4 * hf.config.num_hidden_layers + 1  # qkv, o, gate_up, down per layer, and the (tied) head
    matrices = 7 * hf.config.num_hidden_layers + 1  # q, k, v, o, gate, up, down per layer, and the embedding
    census = {}
    for quant in ("Q8_0", "Q4_1"):
        path = write_gguf(hf, tmp_path / f"{quant}.gguf", "llama", quant=quant)
        model = load_model(str(path), cache_dir=tmp_path / "cache", weights="quantized").model
        census[quant] = _bench().weights_census(str(path), model)
        assert census[quant]["weight_bytes"] == model.weight_bytes
    assert census["Q8_0"]["tensor_types"] == {"Q8_0": matrices}
    assert census["Q8_0"]["tensors_without_kernel"] == 0
    assert (census["Q8_0"]["projections_quantized"], census["Q8_0"]["projections_fp32"]) == (projections, 0)
    assert census["Q4_1"]["tensor_types"] == {"Q4_1": matrices}
    assert census["Q4_1"]["tensors_without_kernel"] == matrices
    assert (census["Q4_1"]["projections_quantized"], census["Q4_1"]["projections_fp32"]) == (0, projections)
    assert census["Q8_0"]["weight_bytes"] < census["Q4_1"]["weight_bytes"] / 3  # blocks against fp32

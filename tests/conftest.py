"""Shared fixtures: the packaged SmolLM2 (converted once into a stable cache dir) and thread limits."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from kvbench.store import faults

os.environ.setdefault("KVBENCH_CACHE_DIR", str(Path.home() / ".cache" / "kvbench"))
os.environ.setdefault("WANDB_MODE", "disabled")
# one thread: tests are small, and two OpenMP threads on a busy 2-core machine can run 40x slower
torch.set_num_threads(1)

# absl's logging handler (imported by rouge-score) holds the sys.stderr of the moment it was imported, and its
# close() closes that stream unless it is the sys.stderr/stdout of the moment of closing. Hydra's logging setup
# (logging.config.dictConfig) closes every handler. Imported while pytest's global capture was sys.stderr and closed
# during an in-process CLI test (capsys then holds sys.stderr), it closed pytest's capture file: every later test of
# that process errored ("I/O operation on closed file"). Its stream is set to the process's own stderr, which absl
# never closes (tests/app/test_capture_safety.py).
try:
    import absl.logging

    absl.logging.get_absl_handler().python_handler.stream = sys.__stderr__
except ImportError:
    pass

try:  # property tests draw the same examples on every run (CI must not depend on luck); HYPOTHESIS_PROFILE=default
    from hypothesis import settings  # explores new ones

    settings.register_profile("kvbench", derandomize=True, database=None)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "kvbench"))
except ImportError:
    pass


@pytest.fixture(scope="session")
def smollm2():
    """The packaged SmolLM2-135M-Instruct in the kvbench runtime, with its transformers model kept."""
    from kvbench.runtime.model.loading import load_model

    return load_model(keep_hf=True)


@pytest.fixture
def fault_points():
    """kvbench.store.faults for this test: install callbacks at its named points; all are removed afterwards."""
    faults.clear()
    yield faults
    faults.clear()


# The heaviest end-to-end runs (multi-process launches, console scripts in a fresh environment, a second vector
# width), each beside a lighter check of the same path that the default suite keeps (named after each): they run
# under `make test-all`, so `make test` stays within its time.
HEAVY_END_TO_END = {
    "tests/tasks/test_lm_eval_cli.py::test_lm_eval_console_script_finds_kvbench_and_its_tasks": "test_lm_eval_adapter",
    "tests/app/test_distributed_app.py::test_self_driven_tasks_split_over_data_parallel_ranks":
        "test_data_parallel_run_equals_one_process",
    "tests/app/test_distributed_app.py::test_tensor_parallel_run_sums_the_ranks_pools": "test_distributed_tp",
    "tests/app/test_distributed_app.py::test_a_killed_rank_fails_the_run_cleanly": "tests/faults/test_kill.py",
    "tests/runtime/test_cpu_kernels.py::test_kernel_tests_pass_at_the_other_vector_width": "this width's kernel tests",
    "tests/app/test_api.py::test_pipeline_answer_is_the_needle_tasks": "test_evaluate_gives_the_cli_metrics_and_folder",
    "tests/store/test_sweeps.py::test_submitit_tasks_of_one_job_form_one_data_parallel_run":
        "test_joblib_sweep_records_every_run_once_and_reports_failures",
    "tests/store/test_sweeps.py::test_submitit_local_sweep": "test_joblib_sweep_records_every_run_once_and_reports_failures",
    "tests/app/test_launch_bad_input.py::test_bad_input_in_a_launch_is_one_line_from_rank_0": "test_bad_input.py",
    "tests/methods/test_contract.py::test_the_one_file_method_runs_tensor_parallel": "test_distributed_tp",
    "tests/app/test_cli.py::test_python_m_kvbench_from_the_folder_that_holds_a_checkout_named_kvbench":
        "test_a_sweep_ends_with_one_table_of_its_runs",
    "tests/app/test_cli.py::test_run_rerun_and_sweep_from_another_directory":
        "test_a_sweep_ends_with_one_table_of_its_runs and tests/store's rerun tests",
    "tests/faults/test_unwritable.py::test_rerun_into_a_folder_that_became_read_only": "test_unwritable.py's others",
    "tests/methods/test_streaming_llm_ppl.py::test_attention_sinks_keep_windowed_perplexity_close_to_full":
        "streaming_llm in tests/methods/test_matrix.py and its parity tests",
    "tests/app/test_wandb.py::test_a_sweeps_runs_share_a_group_and_its_end_logs_a_table_and_plots":
        "test_offline_run_lands_in_the_run_folder",
    "tests/app/test_integral_floats.py::test_budget_as_a_float_is_the_integer_run": "tests/app/test_config.py",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.split("[")[0] in HEAVY_END_TO_END:
            item.add_marker(pytest.mark.slow)

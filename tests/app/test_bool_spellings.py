"""True/false settings take `true` / `false` only, one rule (kvbench.run.spec.check_bool) for every such key, on the
command line as in the schema: `adaptive=yes` is refused as `cuda_graphs=maybe` is."""
from __future__ import annotations

import pytest

from kvbench.run.config import bool_keys
from kvbench.errors import UserError
from kvbench.run.spec import check_bool_spellings


@pytest.mark.parametrize("arg", ["runtime.speculative.adaptive=yes", "runtime.cuda_graphs=maybe", "rerun=1",
                                 "+rerun=no", "logger.wandb=true,on", "progress=off"])
def test_other_spellings_are_refused(arg):
    with pytest.raises(UserError, match="expected true or false"):
        check_bool_spellings([arg], bool_keys())


@pytest.mark.parametrize("arg", ["runtime.speculative.adaptive=true", "runtime.cuda_graphs=false", "rerun=True",
                                 "logger.wandb=false,true", "task.data_path=yes", "budget=1", "-m"])
def test_true_false_and_other_keys_pass(arg):
    check_bool_spellings([arg], bool_keys())


def test_the_schema_bool_keys_are_found():
    assert {"runtime.speculative.adaptive", "runtime.cuda_graphs", "rerun", "logger.wandb"} <= bool_keys()

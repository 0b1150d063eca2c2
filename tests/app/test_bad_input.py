"""Bad input, as typed on the command line: exit code 2, exactly one stderr line naming the bad value, nothing left in
results_dir, and no model loaded. The one table of such cases (CASES) runs the real CLI entry (Hydra included) in this
process; a few more (SUBPROCESS_CASES, one per kind of error) run `python -m kvbench` as real subprocesses."""
from __future__ import annotations

import json
import os
import signal
import sys
from types import SimpleNamespace

import pytest

from tests.harness_fakes import CONF_DIR  # noqa: F401  (sets KVBENCH_CACHE_DIR)
from tests.app.test_cli import assert_usage_error, kvbench
from tests.app.test_config import _choices as group_choices
from tests.fixtures.gguf_fixtures import header_only_gguf
from kvbench.commands.cli import run_app_cli

CUDA = False
try:
    import torch

    CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    pass

# (command line, text the one stderr line must contain, or a tuple of such texts). {empty}, {textfile}, {gguf}, ...
# are paths made per test (the paths fixture).
CASES = [
    # groups
    (["method=nope"], ("unknown method 'nope': choices are ", *group_choices("method"))),
    (["task=nope"], ("unknown task 'nope': choices are ", *group_choices("task"))),
    (["model=nope"], ("unknown model 'nope': choices are ", *group_choices("model"))),
    (["quant=nope"], "unknown quant 'nope'"),
    (["runtime=nope"], "unknown runtime 'nope'"),
    (["logger=nope"], "unknown logger 'nope'"),
    # top-level knobs
    (["budget=abc"], "invalid budget='abc'"),
    (["budget=-5"], "invalid budget=-5"),
    (["budget=0"], "invalid budget=0"),
    (["method=h2o", "budget=1.5"], "budget=1.5"),
    (["seed=-1"], "invalid seed=-1"),
    (["seed=18446744073709551616"], "invalid seed=18446744073709551616: expected an integer from 0 to 4294967295"),
    (["seed=abc"], "seed='abc'"),
    (["rerun=maybe"], "rerun='maybe'"),
    (["+bugdet=128"], ("unknown option bugdet: valid top-level options are", "did you mean budget?")),
    (["nope=1"], "unknown option nope: valid options are budget"),
    # a compression no scored token of task=perplexity would see (issue 68)
    (["method=snapkv", "budget=32", "task.max_tokens=256"],
     "budget=32 with task.max_tokens=256 and task.chunk_size=256: the method compresses after each chunk"),
    (["method=snapkv", "budget=32", "task.max_tokens=256", "task.chunk_size=null"],
     "budget=32 with task.max_tokens=256 and runtime.prefill_chunk_size=512"),
    (["method=snapkv", "budget=300", "task.max_tokens=256", "task.chunk_size=64"],
     "budget=300 with task.max_tokens=256: the cache never holds more than the budget"),
    (["method=snapkv", "compression_ratio=0.5", "task.max_tokens=200"],
     "compression_ratio=0.5 with task.max_tokens=200 and task.chunk_size=256: every token is scored in the first"),
    (["method=quest", "budget=64"], "method=quest reads selected pages in decode steps only"),
    (["method=quest", "budget=64", "task.chunk_size=1"], "method=quest reads selected pages in decode steps only"),
    # runtime
    (["runtime.block_size=0"], "invalid runtime.block_size=0"),
    (["runtime.block_size=x"], "invalid runtime.block_size='x': expected an integer"),
    (["runtime.block_size=1000000000"], "invalid runtime.block_size=1000000000"),
    (["runtime.num_blocks=1"], "invalid runtime.num_blocks=1"),
    (["runtime.num_blocks=10"], "runtime.num_blocks=10"),
    (["runtime.kv_memory_bytes=1000"], "runtime.kv_memory_bytes=1000"),
    (["runtime.prefill_chunk_size=0"], "runtime.prefill_chunk_size=0"),
    (["runtime.batch_size=0"], "runtime.batch_size=0"),
    (["runtime.threads=0"], "runtime.threads=0"),
    (["runtime.attention_backend=fast"], "invalid runtime.attention_backend='fast': choices are auto, torch"),
    (["+runtime.blocks=3"], "runtime.blocks"),
    (["+runtime.threds=2"], "unknown option runtime.threds"),
    (["runtime.speculative=abc"], "invalid runtime.speculative='abc': expected its options"),  # was AttributeError
    # model
    (["model.dtype=int3"], "invalid model.dtype='int3': choices are float32, bfloat16, float16"),
    (["model.device=tpu"], "invalid model.device='tpu'"),
    (["model.weights=int4"], "invalid model.weights='int4': choices are quantized, dequantize"),
    (["model.quant_activations=q4"], "invalid model.quant_activations='q4': choices are fp32, q8"),
    (["model=hf"], "model.path"),
    (["model=hf", "model.path=/no/such/model"], "/no/such/model"),
    (["model.path={empty}"], "empty folder"),
    (["model.path={textfile}"], "notes.txt"),
    (["model.path={gguf}"], "broken.gguf"),
    # RoPE kvbench does not compute as transformers does (issue 68)
    (["model.path={dynrope}"], "rope_type='dynamic' in config.json (dynamic NTK scaling) is not implemented"),
    (["model.path={dynrope5}"], "rope_type='dynamic' in config.json (dynamic NTK scaling) is not implemented"),
    (["model.path={longrope}", "task=needle", "task.lengths=[512]"], "exceed the model's 256 positions"),
    # sequences past the model's positions (longrope: its original ones), before the load (issue 68 item 4)
    (["model.path={longrope}", "task.max_tokens=512"],
     "invalid task.max_tokens=512: a window past the model's 256 positions"),
    (["task.max_tokens=9000", "budget=64", "task.chunk_size=64"],
     ("invalid task.max_tokens=9000: a window past the model's 8192 positions", "position_mode=reindex")),
    (["model.path={longrope}", "task=longbench", "task.datasets=[trec]", "task.data_dir={empty}"],
     "invalid task.max_length=7500: with the 64 tokens trec generates, past the model's 256 positions"),
    (["task=longbench", "task.datasets=[trec,gov_report]", "task.max_length=8000", "task.data_dir={empty}"],
     ("invalid task.max_length=8000: with the 512 tokens gov_report generates", "expected at most 7680")),
    (["task=ruler", "task.source=hub", "task.data_dir={rulerlong}", "task.lengths=[1024]"],
     ("its RULER niah_single_1 sample 2 at length 1024 needs at least 9010 tokens", "model's 8192 positions")),
    (["model.path=packaged:gemma-9"], ("model.path='packaged:gemma-9'", "packaged:gemma-3-270m")),
    (["model.path={twoggufs}"], ("several .gguf files (a.gguf, b.gguf)", "model.gguf_file")),
    (["model.path={deepseek_gguf}"], ("unsupported GGUF architecture 'deepseek2'", "gemma2, gemma3, llama")),
    (["+model.nme=x"], "model.nme"),
    # logger
    (["logger.mode=sometimes"], "invalid logger.mode='sometimes'"),
    (["logger.wandb=maybe"], ("logger.wandb='maybe'", "expected true or false")),
    (["logger.init_timeout_s=0"], "invalid logger.init_timeout_s=0"),
    # storage codecs
    (["method=kivi", "quant=int8"], ("quant=int8", "both choose a storage codec")),
    (["quant=kivi", "quant.bits=5"], "bits"),
    (["method=kivi", "method.bits=5"], "bits"),
    (["quant=kivi", "quant.key_axis=diagonal"], "diagonal"),
    (["quant=kvquant", "quant.bits=7"], "7"),
    (["quant=kvquant", "quant.levels=fancy"], "fancy"),
    (["+quant.foo=1"], "foo"),
    (["quant=int8", "+quant.bits=4"], "bits"),
    # methods and their options
    (["method=h2o", "budget=64", "method.recent_ratio=2.0"], "recent_ratio"),
    (["method=snapkv", "budget=64", "method.window=0"], "window"),
    (["method=streaming_llm", "budget=64", "method.sinks=-1"], "sinks"),
    (["method=paged_eviction", "budget=64", "method.heads=some"], "some"),
    (["method=key_diff", "budget=64", "+method.nope=1"], "nope"),
    (["method=kvcrush", "budget=64", "method.anchor=nowhere"], "nowhere"),
    (["method=h2o", "+method.nope=1"], "nope"),
    # tasks and their options
    (["task.max_tokens=lots"], "task.max_tokens='lots'"),
    (["task.max_tokens=1"], "task.max_tokens=1"),
    (["task.nope=1"], "unknown option task.nope: valid options are"),
    (["task.corpus=books"], "task.corpus='books'"),
    (["task.text_file=/no/such/file.txt"], "/no/such/file.txt"),
    (["task=needle", "+task.nope=1"], "task.nope"),
    (["task=longbench", "+task.nope=1"], "task.nope"),
    (["task=summarization", "+task.nope=1"], "task.nope"),
    # serving: the scheduler's knobs and the throughput trace
    (["runtime.max_num_seqs=0"], "runtime.max_num_seqs=0"),
    (["runtime.max_num_batched_tokens=0"], "runtime.max_num_batched_tokens=0"),
    (["runtime.admission_watermark=1.5"], "runtime.admission_watermark=1.5"),
    (["task=throughput", "task.request_rate=0"], "task.request_rate=0"),
    (["task=throughput", "task.request_rate=-3"], "task.request_rate=-3"),
    (["task=throughput", "task.num_requests=0"], "task.num_requests=0"),
    (["task=throughput", "task.input_tokens=[9000,9000]"], "8192"),
    (["task=throughput", "task.output_tokens=[50,10]"], "task.output_tokens"),
    (["task=throughput", "runtime.kv_memory_bytes=100000"], "runtime.kv_memory_bytes=100000"),
    # decode policies and SnapKV pooling
    (["method=snapkv", "budget=64", "method.decode=slide"], "snapkv.decode='slide'"),
    (["method=h2o", "budget=64", "method.decode=block"], "h2o.decode='block'"),
    (["method=snapkv", "budget=64", "method.pooling=median"], "median"),
    (["method=kvcompose", "budget=64", "method.agg_group=sum"], ("kvcompose.agg_group='sum'", "mean, max")),
    (["method=think", "budget=64", "method.key_channel_compression_ratio=1.0"],
     ("think.key_channel_compression_ratio=1:", "[0, 1)")),
    (["method=think", "budget=64", "method.key_channel_compression_ratio=-0.25"],
     "think.key_channel_compression_ratio=-0.25"),
    (["method=think", "budget=64", "method.key_channel_compression_ratio=abc"],
     "think.key_channel_compression_ratio='abc'"),
    (["method=think", "budget=64", "method.key_channel_compression_ratio=0.5", "quant=int8"],
     ("method=think", "quant=int8")),
    (["method=paged_eviction", "budget=16"], "budget=16"),
    # sweeps: the bad value is refused, the good ones are not run
    (["-m", "budget=64,abc"], "budget='abc'"),
    # issue 23: found before the model loads, no longer as a failed run or a traceback after it
    (["task.text_file={emptyfile}"], "is empty"),
    (["task.text_file={blankfile}"], "holds only whitespace"),
    (["task.text_file=' '"], "task.text_file=' '"),
    (["task.text_file={fifo}"], "is not a regular file"),
    (["task=needle", "task.lengths=[100000]"], "task.lengths=[100000]"),
    (["task=needle", "task.max_new_tokens=100000"], "task.max_new_tokens=100000"),
    (["task=needle", "task.lengths=[64]", "task.buffer_tokens=100"], "task.buffer_tokens=100"),
    (["task=summarization", "task.limit=0"], "task.limit=0"),
    (["task=longbench", "task.limit=0"], "task.limit=0"),
    (["task=govreport", "task.limit=0"], "task.limit=0"),
    (["task=longbench", "task.data_dir={empty}"], "has no narrativeqa.jsonl"),
    # reasoning tasks, LongBench v2, rkv
    (["task=aime", "task.sets=[2023]"], ("unknown AIME set 2023", "choices are 2024, 2025")),
    (["task=math500", "task.num_samples=0"], "task.num_samples=0"),
    (["task=gsm8k", "task.max_new_tokens=9000"], ("task.max_new_tokens=9000", "8192 positions")),
    (["task=math500", "task.data_path=/no/such/data"], "task.data_path='/no/such/data'"),
    (["task=aime", "task.data_path={empty}"], "no 'train' split files"),
    (["task=gsm8k", "task.top_p=0"], "task.top_p=0"),
    (["task=math500", "task.prompt_style=cot"], ("task.prompt_style='cot'", "r1, rkv")),
    (["task=longbench_v2", "task.data_path={empty}"], "no 'train' split files"),
    (["task=longbench_v2", "task.max_new_tokens=8192"], "task.max_new_tokens=8192"),
    (["method=rkv", "budget=8"], "must exceed rkv.window=8"),
    (["task=longbench", "task.data_dir=''"], "task.data_dir=''"),
    (["task=longbench", "task.datasets=[trec]", "task.data_dir={textfile}"], "neither a folder nor a zip"),
    (["task=govreport", "task.data_dir={empty}"], "has no gov_report.jsonl"),
    (["task=govreport", "task.source=ccdv", "task.data_dir={empty}"], "no GovReport 'test' data"),
    (["task.corpus=wikitext", "task.data_path=/no/such/data"], "task.data_path='/no/such/data'"),
    (["task.corpus=wikitext", "task.data_path={empty}"], "no 'test' split files"),
    (["task.corpus=pg19", "task.data_path=''"], "task.data_path=''"),
    (["task.data_path={textfile}"], "does not read it"),
    (["model=hf", "model.path=nobody/no-such-model-kvbench"], "not in the local Hugging Face cache",
     {"env": {"HF_HUB_OFFLINE": "1"}}),
    (["task=lm_eval", "task.tasks=[kvbench_essays_mc]"], "needs lm-eval", {"hide": ["lm_eval"]}),
    (["task=lm_eval", "task.tasks=[a:b]", "task.include_defaults=false"], "unknown lm-eval task(s) a:b"),
    (["quant=kvquant", "quant.calibration_tokens=100000"], "quant.calibration_tokens=100000"),
    (["quant=kvquant", "quant.bits=3.5"], "quant.bits=3.5"),
    (["quant=kivi", "quant.group_size=32.5"], "quant.group_size=32.5"),
    (["quant=nvfp4", "quant.rotate=spin"], ("quant.rotate='spin'", "none, hadamard")),
    (["quant=nvfp4", "quant.tensor_amax=-3"], "tensor_amax=-3"),
    (["quant=mxfp4", "quant.tensor_amax=3"], ("unknown option quant.tensor_amax", "rotate")),
    (["quant=kivi", "quant.rotate_seed=0.5"], "quant.rotate_seed=0.5"),
    (["runtime.num_blocks=1e12"], "invalid runtime.num_blocks=1000000000000: 1000000000000 blocks"),
    (["runtime.num_blocks=1000000000000"], "runtime.num_blocks=1000000000000"),
    (["runtime.kv_memory_bytes=1000000000000000"], "runtime.kv_memory_bytes=1000000000000000"),
    (["task.max_tokens=1e12"], "task.max_tokens=1000000000000"),
    (["task.max_tokens=1000000000000"], "task.max_tokens=1000000000000"),
    (["task.max_tokens=200000"], "task.max_tokens=200000"),
    (["runtime.num_blocks=5000"], "larger runtime.num_blocks"),  # 4096 tokens of full KV need 23,297 blocks
    (["quant=kivi", "quant.group_size=100000"], "G=100000"),
    (["quant=kivi", "quant.group_size=100000", "quant.residual=100000"], "quant.group_size=100000"),
    (["quant=kivi", "quant.group_size=4096", "quant.residual=4096", "runtime.kv_memory_bytes=50000000"],
     "quant.group_size=4096"),
    (["method=kvcrush", "budget=64", "method.seed=1e21"], "method.seed=1e+21"),
    (["method=kvcrush", "budget=64", "method.seed=100000000000000000000"], "method.seed=100000000000000000000"),
    (["task=throughput", "task.request_rate=1e-300"], "task.request_rate=1e-300"),
    (["task=throughput", "task.request_rate=0.001"], "task.request_rate=0.001"),
    (["budget=${{oc.env:NOPE}}"], "cannot resolve budget='${{oc.env:NOPE}}'"),  # {{ }}: the table's str.format escapes
    (["task.max_tokens=${{nope}}"], "task.max_tokens='${{nope}}'"),
    (["results_dir=${{oc.env:KVBENCH_NO_SUCH_VAR}}"], "Environment variable 'KVBENCH_NO_SUCH_VAR' not found"),
    (["-m", "results_dir=${{oc.env:KVBENCH_NO_SUCH_VAR}}"], "KVBENCH_NO_SUCH_VAR"),
    (["model.path=/dev/null"], "model.path='/dev/null' is not a regular file or folder"),
    # speculative decoding and preemption (runtime.speculative, runtime.preemption, runtime.swap_bytes)
    (["runtime.speculative.num_tokens=-1"], "invalid runtime.speculative.num_tokens=-1"),
    (["runtime.speculative.num_tokens=1000"], "runtime.speculative.num_tokens=1000: expected an integer from 0 to 64"),
    (["task=throughput", "runtime.speculative.num_tokens=4", "runtime.speculative.method=streamin_llm"],
     ("unknown runtime.speculative.method 'streamin_llm'", "did you mean streaming_llm?")),
    (["task=throughput", "runtime.speculative.num_tokens=4", "runtime.speculative.budget=0"],
     "runtime.speculative.budget=0"),
    (["task=throughput", "runtime.speculative.num_tokens=4", "runtime.speculative.budget=100000"],
     ("invalid runtime.speculative.budget=100000", "compress nothing")),
    (["runtime.swap_bytes=1000000000000000"],
     ("invalid runtime.swap_bytes=1000000000000000", "more than this host's")),
    (["task=throughput", "runtime.speculative.num_tokens=4", "runtime.speculative.draft=/no/such/draft"],
     "runtime.speculative.draft='/no/such/draft' does not exist"),
    (["task=throughput", "runtime.speculative.num_tokens=4", "runtime.speculative.draft={othertok}"],
     ("runtime.speculative.draft=", "tokenizer differs from the target model's")),
    (["task=throughput", "method=h2o", "budget=64", "runtime.speculative.num_tokens=4"],
     "runtime.speculative.num_tokens=4 cannot run with method=h2o"),
    (["runtime.speculative.num_tokens=4"], "runtime.speculative.num_tokens=4 cannot run with task=perplexity"),
    (["task=throughput", "runtime.speculative.num_tokens=4", "runtime.prefix_caching=true"],
     "cannot run with runtime.prefix_caching=true"),
    (["+runtime.speculative.k=4"], "runtime.speculative.k"),
    (["runtime.swap_bytes=-5"], "invalid runtime.swap_bytes=-5"),
    (["runtime.preemption=swapp"], ("invalid runtime.preemption='swapp'", "did you mean swap?")),
    (["model.path={fifo}"], "is not a regular file or folder"),
    # issue 37: found in the plan (a tokenizer may load there, the model may not), no longer after the model loaded
    (["task=ruler", "task.lengths=[100000]"], ("invalid task.lengths=[100000]", "model's 8192 positions")),
    (["task=ruler", "task.lengths=[20]", "task.tasks=[niah_single_1]"],
     ("invalid task.lengths=[20]", "no room for a niah_single_1 sample")),
    (["task=ruler", "task.source=hub", "task.data_dir=/nonexistent/dir"], "task.data_dir='/nonexistent/dir'"),
    (["task=ruler", "task.source=hub", "task.data_dir={empty}", "task.lengths=[1024]"],
     "no 1024.parquet/.jsonl or 1024/ folder"),
    (["task=ruler", "task.tasks=[qa_1]"], ("nothing to run", "squad.json")),
    (["task=ruler", "task.compress_answer_prefix=true"],
     ("task.compress_answer_prefix=true needs task.compress_question=true",)),
    (["task=ruler", "task.compress_question=true", "task.compress_answer_prefix=maybe"],
     "invalid task.compress_answer_prefix='maybe': expected true or false"),
    (["task=ruler", "task.tasks=[qa_1,qa_2]", "task.data_dir={empty}"], ("squad.json", "hotpotqa.json")),
    (["method=h2o", "budget=64", "runtime.prefix_caching=true"], "runtime.prefix_caching=true with method=h2o"),
    (["method=adakv", "method.base=h2o", "budget=64", "runtime.prefix_caching=true"],
     "runtime.prefix_caching=true with method=adakv"),
    (["method=h2o", "budget=64", "runtime.prefix_caching=1"], "runtime.prefix_caching=true"),
    # threshold eviction (methods/dms.py) and KVzap
    (["method=dms", "method.threshold=abc"], "invalid method.threshold='abc': expected a finite number"),
    (["method=dms", "method.threshold=-3", "budget=64"], "method.threshold=-3 and budget=64 are both set"),
    (["method=dms", "method.threshold=-3", "compression_ratio=0.5"],
     "method.threshold=-3 and compression_ratio=0.5 are both set"),
    (["method=dms"], "invalid dms.threshold=None: expected a finite number"),
    (["method=dms", "method.threshold=-3", "+method.base_options.surrogate=quadratic"],
     "invalid kvzap.surrogate='quadratic': choose one of linear, mlp"),
    (["method=kvzap", "method.surrogate=quadratic", "compression_ratio=0.5"],
     "invalid kvzap.surrogate='quadratic': choose one of linear, mlp"),
    (["-m", "method=dms", "method.threshold=-3,x"], "invalid method.threshold='x'"),
    (["method=think", "budget=64", "method.key_channel_compression_ratio=0.5", "runtime.prefix_caching=true"],
     "runtime.prefix_caching=true with method=think"),
    # every job of a sweep is checked before the first starts (the first would load the model: no_loading fails it)
    (["-m", "method=streaming_llm", "budget=64,-5"], "invalid budget=-5"),
    (["method=streaming_llm", "-m", "budget=64,-5"], "invalid budget=-5"),  # -m after an override
    (["-m", "task=needle", "task.lengths=[64],[100000]"], "task.lengths=[100000]"),
    # counts are bounded (docs/configuration.md)
    (["task=throughput", "task.num_requests=1000000000000"], "invalid task.num_requests=1000000000000"),
    (["task=ruler", "task.limit=1000000000000"], "invalid task.limit=1000000000000"),
    (["task.num_documents=1000000000000"], "invalid task.num_documents=1000000000000"),
    (["task=lm_eval", "task.tasks=[x]", "task.bootstrap_iters=1000000000000"], "task.bootstrap_iters"),
    (["task=needle", "task.max_new_tokens=1000000000000"], "task.max_new_tokens=1000000000000"),
    (["runtime.max_num_seqs=1000000000000"], "runtime.max_num_seqs=1000000000000"),
    (["runtime.batch_size=1000000000000"], "runtime.batch_size=1000000000000"),
    (["runtime.max_num_batched_tokens=1000000000000"], "runtime.max_num_batched_tokens=1000000000000"),
    (["runtime.prefill_chunk_size=1000000000000"], "runtime.prefill_chunk_size=1000000000000"),
    (["results_dir=''"], "invalid results_dir=''"),
    (["-m", "results_dir=''"], "invalid results_dir=''"),
    (["task=ruler", "task.lengths=100000"], "task.lengths=[100000]"),  # a bare length is a list of one
    # scbench (SCBench's two modes)
    (["task=scbench", "task.mode=multi_chat"], "invalid task.mode='multi_chat': choices are multi_turn, multi_request"),
    (["task=scbench", "task.turns=0"], "invalid task.turns=0: expected an integer >= 1"),
    (["task=scbench", "task.tasks=[passkey]"], ("unknown SCBench task 'passkey'", "kv, prefix_suffix, vt")),
    (["task=scbench", "task.length=100000"], ("invalid task.length=100000", "model's 8192 positions")),
    (["task=scbench", "task.source=hub", "task.data_dir={scbnoturns}", "task.tasks=[kv]"],
     ("scbench_kv.jsonl, row 1", "no 'multi_turns' field")),
    (["task=scbench", "task.source=hub", "task.data_dir={scbnoanswer}", "task.tasks=[kv]"],
     ("multi_turns[0] needs 'input' and 'answer'",)),
    (["task=scbench", "task.source=hub", "task.data_dir={empty}", "task.tasks=[kv]"], "no scbench_kv.jsonl"),
    (["task=scbench", "task.repeats=2"], "invalid task.repeats=2"),
    # SCBench's hub tasks: the fields their prompts and scorers read
    (["task=scbench", "task.source=hub", "task.data_dir={scbchoice}", "task.tasks=[choice_eng]"],
     ("scbench_choice_eng.jsonl, row 1", "multi_turns[0]: field 'options' must be a list of 4 texts")),
    (["task=scbench", "task.source=hub", "task.data_dir={scbmf}", "task.tasks=[mf]"],
     ("scbench_mf.jsonl, row 1", "multi_turns[0]", "a number 'answer'")),
    (["task=scbench", "task.source=hub", "task.data_dir={scbrepo}", "task.tasks=[repoqa]", "task.turns=1"],
     ("scbench_repoqa.jsonl, row 1", "needs a text field 'repo'")),
    (["task=scbench", "task.source=hub", "task.data_dir={scbmixed}", "task.tasks=[summary_with_needles]"],
     ("scbench_summary_with_needles.jsonl, row 1", "multi_turns[1]: field 'task' must be one of")),
    (["task=scbench", "task.source=hub", "task.data_dir={empty}", "task.tasks=[repoqa]"],
     ("invalid task.length=4096", "scbench_repoqa's 5 turns generate up to 5120 tokens")),
    (["task=scbench", "task.tasks=[qa_eng]"],
     "task.tasks=['scbench_qa_eng'] are not generated: use task.source=hub"),
    # issue 56: a model kvbench cannot run as its files describe it, refused from config.json and the tensors' names
    (["model.path={fewlayers}"], ("its weights do not match its config.json", "missing 18 tensors",
                                  "model.layers.2.input_layernorm.weight", "(layers 2-3)")),
    (["model.path={badtype}"], ("unsupported model_type 'gpt2'", "supported: llama, mistral, qwen2, qwen3, phi3")),
    (["model.path={kvzero}"], "invalid num_key_value_heads=0 in config.json"),
    (["model.path={negpos}"], "invalid max_position_embeddings=-1 in config.json"),
    (["model.path={oddhidden}"], "hidden_size=66 in config.json is not divisible by num_attention_heads=4"),
    (["model.path={custom}"], ("config.json names custom code (auto_map: AutoModelForCausalLM)",)),
    (["model.path={window}"], ("invalid sliding_window=0 in config.json: expected a positive integer",)),
    # issue 56: data rows checked against the task's schema (types) and encodings, before the model loads
    (["task=longbench", "task.datasets=[trec]", "task.data_dir={lbnull}"],
     ("task.data_dir file {lbnull}/trec.jsonl:2: field 'context' is null; expected a string",)),
    (["task=longbench", "task.datasets=[trec]", "task.data_dir={lbdict}"],
     ("trec.jsonl:1: field 'answers' is an object; expected a non-empty list of strings",)),
    (["task=longbench", "task.datasets=[trec]", "task.data_dir={lbempty}"], ("trec.jsonl holds no rows",)),
    (["task=longbench", "task.datasets=[trec]", "task.data_dir={lbutf16}"], ("trec.jsonl: UTF-16",)),
    (["task=longbench", "task.datasets=[trec]", "task.data_dir={lbbadline}"], ("trec.jsonl:2: invalid JSON",)),
    (["task=govreport", "task.data_dir={lbgov}"], ("gov_report.jsonl:1: field 'context' is a number (7)",)),
    (["task=govreport", "task.source=ccdv", "task.data_dir={ccdvbad}"],
     ("task.data_dir file", "test.jsonl, line 2: column 'summary' is null; expected text")),
    (["task.corpus=wikitext", "task.data_path={wtnotext}"], ("no 'text' column", "it has content")),
    (["task=ruler", "task.source=hub", "task.data_dir={rulernull}", "task.lengths=[1024]"],
     ("task.data_dir file {rulernull}/1024.jsonl:3: field 'context' is null; expected a string",)),
    (["task=ruler", "task.source=hub", "task.data_dir={rulerdict}", "task.lengths=[1024]"],
     ("1024.jsonl:1: field 'answer' is an object; expected a non-empty list of strings",)),
    (["task=ruler", "task.source=hub", "task.data_dir={rulernew}", "task.lengths=[1024]"],
     ("1024.jsonl:1: field 'max_new_tokens' is a string ('8'); expected a whole number >= 1",)),
    (["task=ruler", "task.source=hub", "task.data_dir={rulerutf16}", "task.lengths=[1024]"],
     ("1024.jsonl: not UTF-8 text",)),
    # issue 56: hub data pinned by revision (task.revision), refused where it pins nothing
    (["task=longbench", "task.revision=main", "task.data_dir={empty}"],
     "task.revision='main' pins the hub's data but task.data_dir="),
    (["task=ruler", "task.revision=main"], "task.revision is set but task.source='generate' reads no hub data"),
    (["task.revision=main"], "task.revision is set but task.corpus='pg_essays' is not read from the hub"),
    (["task=longbench_v2", "task.revision='a b'"], "invalid task.revision='a b'"),
    (["task=aime", "task.sets=[2024,2025]", "task.revision=main"], "names one revision but task.sets="),
    (["task.corpus=wikitext", "task.data_path={wtnumbers}"],
     ("line 2: column 'text' is a JSON int (5); expected text",)),
    (["task.text_file={utf16}"], "is UTF-16 text (byte order mark fffe)"),
    # issue 56: integral floats are integers; one too large to be exact says so, and a bound names the bound
    (["budget=1e20"], ("invalid budget=1e+20: too large", "2**53")),
    (["seed=1e20"], "invalid seed=1e+20: too large"),
    (["runtime.speculative.num_tokens=1e9"],
     "invalid runtime.speculative.num_tokens=1000000000: expected an integer from 0 to 64"),
    (["-m", "method=h2o", "budget=64.0,1e20"], "invalid budget=1e+20: too large"),
]
if not CUDA:
    CASES += [(["model.device=cuda"], "model.device='cuda'"),
              (["runtime.attention_backend=triton"], "attention_backend=triton")]


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A tiny Llama model folder in the hub's format (2 layers, safetensors, a tokenizer.json), saved once."""
    from tests.tiny_models import tiny_hf_model

    folder = tmp_path_factory.mktemp("tiny-llama")
    tiny_hf_model("llama", layers=2).save_pretrained(folder)
    (folder / "tokenizer.json").write_text('{"model": {"vocab": {"a": 0, "b": 1}}, "added_tokens": []}')
    return folder


def _model_variant(src, dest, **config_changes):
    """A copy of the model folder src with its config.json changed (a value None removes the key)."""
    import json
    import shutil

    shutil.copytree(src, dest)
    cfg = json.loads((dest / "config.json").read_text())
    cfg.update(config_changes)
    (dest / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    return str(dest)


@pytest.fixture(scope="session")
def paths(tmp_path_factory, tiny_llama_dir):
    """The files and folders the table's {name} placeholders stand for, made once: every case only reads them
    (test_bad_command_line checks that none was changed)."""
    tmp_path = tmp_path_factory.mktemp("bad-input-paths")
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("not a model\n")
    (tmp_path / "broken.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x01" * 7)
    (tmp_path / "twoggufs").mkdir()
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / "twoggufs" / name).write_bytes(b"GGUF")
    header_only_gguf(tmp_path / "ds.gguf", "deepseek2")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.txt").write_text(" \n\t\n  ")
    os.mkfifo(tmp_path / "fifo")  # opening it would block: it must be refused without being opened
    other = tmp_path / "othertok"  # a model folder whose tokenizer is not the packaged model's
    other.mkdir()
    (other / "config.json").write_text('{"num_hidden_layers": 2, "model_type": "llama"}')
    (other / "model.safetensors").write_bytes(b"")
    (other / "tokenizer.json").write_text('{"model": {"vocab": {"a": 0, "b": 1}}, "added_tokens": []}')
    data = {}
    row = {"input": "q", "context": "c", "answers": ["a"], "length": 1, "dataset": "trec", "language": "en",
           "all_classes": ["a", "b"], "_id": "x"}
    ruler_row = {"context": "c", "question": "q", "answer_prefix": "A:", "answer": ["7"], "task": "niah_single_1",
                 "max_new_tokens": 8}
    for name, file, text in (
            ("lbnull", "trec.jsonl", json.dumps(row) + "\n" + json.dumps({**row, "context": None}) + "\n"),
            ("lbdict", "trec.jsonl", json.dumps({**row, "answers": {"a": "0"}}) + "\n"),
            ("lbempty", "trec.jsonl", "\n"),
            ("lbutf16", "trec.jsonl", None),
            ("lbbadline", "trec.jsonl", json.dumps(row) + "\n{\"context\": \n"),
            ("lbgov", "gov_report.jsonl", json.dumps({**row, "context": 7}) + "\n"),
            ("wtnotext", "test.jsonl", json.dumps({"content": "x"}) + "\n"),
            ("ccdvbad", "test.jsonl", json.dumps({"report": "r", "summary": "s"}) + "\n"
             + json.dumps({"report": "r", "summary": None}) + "\n"),
            ("wtnumbers", "test.jsonl", json.dumps({"text": "x"}) + "\n" + json.dumps({"text": 5}) + "\n"),
            ("scbnoturns", "scbench_kv.jsonl", json.dumps({"id": 0, "context": "c", "turns": []}) + "\n"),
            ("scbnoanswer", "scbench_kv.jsonl", json.dumps({"id": 0, "context": "c",
                                                             "multi_turns": [{"input": "q"}]}) + "\n"),
            ("scbchoice", "scbench_choice_eng.jsonl", json.dumps(
                {"id": 0, "context": "c", "multi_turns": [{"input": "q", "answer": "a", "options": ["a", "b"]}]})
             + "\n"),
            ("scbmf", "scbench_mf.jsonl", json.dumps(
                {"id": 0, "context": "c", "multi_turns": [{"input": "The max is", "answer": "7"}]}) + "\n"),
            ("scbrepo", "scbench_repoqa.jsonl", json.dumps(
                {"id": 0, "context": "c", "lang": "python", "multi_turns": [{"input": "q", "answer": "a",
                                                                             "name": "f"}]}) + "\n"),
            ("scbmixed", "scbench_summary_with_needles.jsonl", json.dumps(
                {"id": 0, "context": "c", "multi_turns": [{"input": "q", "answer": "a", "task": "scbench_summary"},
                                                          {"input": "q", "answer": "1", "task": "scbench_kv"}]})
             + "\n"),
            ("rulernull", "1024.jsonl", json.dumps(ruler_row) + "\n\n" + json.dumps({**ruler_row, "context": None})),
            ("rulerdict", "1024.jsonl", json.dumps({**ruler_row, "answer": {"a": "0"}}) + "\n"),
            ("rulernew", "1024.jsonl", json.dumps({**ruler_row, "max_new_tokens": "8"}) + "\n"),
            ("rulerutf16", "1024.jsonl", None),
            ("rulerlong", "1024.jsonl", json.dumps(ruler_row) + "\n"
             + json.dumps({**ruler_row, "context": "word " * 9000}) + "\n")):
        (tmp_path / name).mkdir()
        target = tmp_path / name / file
        if text is None:
            target.write_bytes((json.dumps(row) + "\n").encode("utf-16"))
        else:
            target.write_text(text)
        data[name] = str(tmp_path / name)
    (tmp_path / "utf16.txt").write_bytes("some text to score".encode("utf-16"))
    data["utf16"] = str(tmp_path / "utf16.txt")
    models = {name: _model_variant(tiny_llama_dir, tmp_path / name, **changes) for name, changes in {
        "fewlayers": {"num_hidden_layers": 4}, "badtype": {"model_type": "gpt2"},
        "kvzero": {"num_key_value_heads": 0}, "negpos": {"max_position_embeddings": -1},
        "oddhidden": {"hidden_size": 66}, "custom": {"auto_map": {"AutoModelForCausalLM": "m.M"}},
        "window": {"model_type": "mistral", "sliding_window": 0},
        "dynrope": {"rope_scaling": {"type": "dynamic", "factor": 2.0}},
        "dynrope5": {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}},
        "longrope": {"max_position_embeddings": 4096,  # a Llama with Phi-3.5's RoPE (transformers runs it)
                     "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
                                         "long_factor": [4.0] * 8, "original_max_position_embeddings": 256}}}.items()}
    return {**models, **data, "empty": str(tmp_path / "empty"), "textfile": str(tmp_path / "notes.txt"),
            "gguf": str(tmp_path / "broken.gguf"), "emptyfile": str(tmp_path / "empty.txt"),
            "twoggufs": str(tmp_path / "twoggufs"), "deepseek_gguf": str(tmp_path / "ds.gguf"),
            "blankfile": str(tmp_path / "blank.txt"), "fifo": str(tmp_path / "fifo"), "othertok": str(other),
            "_root": str(tmp_path)}


def _tree(root: str) -> list:
    """Every file and folder under root with its size and modification time (a fifo is stat-ed, not opened)."""
    found = []
    for folder, dirs, files in os.walk(root):
        for name in sorted(dirs + files):
            st = os.lstat(os.path.join(folder, name))
            found.append((os.path.relpath(os.path.join(folder, name), root), st.st_size, st.st_mtime_ns))
    return sorted(found)


@pytest.fixture
def cli(monkeypatch, capsys):
    """Run `python -m kvbench ARGS` in this process; returns (exit code, stdout, stderr)."""
    import hydra

    from kvbench.run import exit_channel

    from kvbench.commands import hydra_task

    entry = hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")(hydra_task.main)
    old_term = signal.getsignal(signal.SIGTERM)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    for key in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(key, raising=False)

    def call(args):
        monkeypatch.setattr(sys, "argv", ["kvbench", *args])
        monkeypatch.setattr(exit_channel, "_exit_code", 0)
        capsys.readouterr()
        with pytest.raises(SystemExit) as info:
            run_app_cli(entry)
        out = capsys.readouterr()
        return info.value.code, out.out, out.err

    yield call
    signal.signal(signal.SIGTERM, old_term)


def test_the_table_is_big_enough():
    assert len(CASES) >= 110


# A case is (command line, needles) or (command line, needles, setup): setup["env"] sets environment variables,
# setup["hide"] makes modules unimportable (as if not installed).
TABLE = [(c[0], (c[1],) if isinstance(c[1], str) else c[1], c[2] if len(c) > 2 else {}) for c in CASES]




def _table_params(table: list) -> list:
    """The table as pytest params: a case whose options (the keys before '=') an earlier case already has is a
    further bad value of the same options, marked slow (`make test-all` runs it)."""
    seen, params = set(), []
    for args, needles, setup in table:
        keys = tuple(a.split("=")[0] for a in args)
        marks = [pytest.mark.slow] if keys in seen else []
        seen.add(keys)
        params.append(pytest.param(args, needles, setup, marks=marks, id=" ".join(args)))
    return params


@pytest.mark.parametrize("args,needles,setup", _table_params(TABLE))
def test_bad_command_line(cli, paths, tmp_path, args, needles, setup, monkeypatch):
    import kvbench.run.app as app

    def no_loading(*a, **k):
        raise AssertionError("the model was loaded for bad input")

    monkeypatch.setattr(app, "_load_model", no_loading)
    for key, value in setup.get("env", {}).items():
        monkeypatch.setenv(key, value)
    for module in setup.get("hide", []):
        monkeypatch.setitem(sys.modules, module, None)
    monkeypatch.chdir(tmp_path)  # a results_dir that cannot be resolved must not leave a folder here either
    before, inputs = set(os.listdir(tmp_path)), _tree(paths["_root"])
    results = tmp_path / "r"
    args = [a.format(**paths) for a in args]
    own_results = any(a.startswith("results_dir=") for a in args)
    code, out, err = cli([*args, "logger.wandb=false", *([] if own_results else [f"results_dir={results}"])])
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, (code, out, err)
    assert len(lines) == 1 and lines[0].startswith("kvbench: error: "), err
    for needle in needles:
        assert needle.format(**paths) in lines[0], (needle, lines[0])
    assert "Traceback" not in out + err
    assert not results.exists(), sorted(os.listdir(results))  # no run folder, no runs.jsonl, no empty folder
    assert set(os.listdir(tmp_path)) == before
    assert _tree(paths["_root"]) == inputs  # the shared inputs are read, never written


# (command line, texts the one stderr line must contain); results_dir is tmp_path/r unless the case names it
# one per kind of error; those marked slow are kinds already here, and every case but experiment=h2o is in CASES
SUBPROCESS_CASES = [
    (["+bugdet=128"], ["did you mean budget?"]),
    pytest.param(["method=nope"], ["unknown method 'nope'", "choices are", "full"], marks=pytest.mark.slow),
    pytest.param(["budget=abc"], ["invalid budget='abc'", "positive integer", "null"], marks=pytest.mark.slow),
    pytest.param(["task.corpus=books"], ["task.corpus='books'", "pg_essays, aclsum, wikitext, pg19, text_file"],
                 marks=pytest.mark.slow),
    (["-m", "budget=64,abc"], ["invalid budget='abc'"]),
    (["experiment=h2o"], ["experiment is not in the default config", "+experiment=h2o"]),
    (["model=hf", "model.path=/no/such/model", "results_dir=r"], ["model.path='/no/such/model' does not exist"]),
]


@pytest.mark.parametrize("args,needles", SUBPROCESS_CASES,
                         ids=[" ".join((c.values if hasattr(c, "values") else c)[0]) for c in SUBPROCESS_CASES])
def test_bad_input_as_a_real_subprocess(tmp_path, args, needles):
    has_results_dir = any(a.startswith("results_dir=") for a in args)
    proc = kvbench(*args, "logger.wandb=false", *([] if has_results_dir else [f"results_dir={tmp_path / 'r'}"]),
                   cwd=tmp_path)
    assert_usage_error(proc, *needles)
    left = sorted(os.listdir(tmp_path / "r")) if (tmp_path / "r").exists() else []
    assert left in (([], ["multirun.yaml"]) if "-m" in args else ([],)), left  # a sweep saves its config


def _hub_cache_with(root, repo_id, config):
    """A Hugging Face hub cache at root holding repo_id's config.json (its layout: refs/main -> snapshots/<rev>)."""
    import json

    repo = root / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    snap = repo / "snapshots" / ("0" * 40)
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps(config))


def test_a_cached_hub_model_is_checked_against_its_config(cli, tmp_path, monkeypatch):
    # offline, a hub id in the local cache passes, and its config.json (not the weights) bounds the task
    import huggingface_hub.constants

    import kvbench.run.app as app
    from kvbench.run.model_info import model_shape

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _hub_cache_with(tmp_path / "hub", "org/tiny-llama", {
        "model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64,
        "max_position_embeddings": 512})
    shape = model_shape(SimpleNamespace(path="org/tiny-llama", gguf_file=None))
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.max_positions) == (2, 2, 16, 512)

    monkeypatch.setattr(app, "_load_model", lambda *a, **k: pytest.fail("the model was loaded for bad input"))
    code, out, err = cli(["model=hf", "model.path=org/tiny-llama", "task=needle", "task.lengths=[1024]",
                          "logger.wandb=false", f"results_dir={tmp_path / 'r'}"])
    assert code == 2 and "invalid task.lengths=[1024]" in err and "model's 512 positions" in err, err
    assert not (tmp_path / "r").exists() or not os.listdir(tmp_path / "r")


def test_a_hub_id_the_hub_does_not_know_is_refused(cli, tmp_path, monkeypatch):
    # online: the hub is asked for config.json (a few kB) before the model loads; "no such repository" is one line
    import huggingface_hub
    from huggingface_hub.errors import RepositoryNotFoundError

    import kvbench.run.app as app
    import kvbench.data.hub as hub

    def not_found(repo_id, filename, **kwargs):
        exc = RepositoryNotFoundError.__new__(RepositoryNotFoundError)
        Exception.__init__(exc, f"404 Client Error: Repository Not Found for url: .../{repo_id}")
        raise exc

    monkeypatch.setattr(hub, "hub_unreachable_reason", lambda *a, **k: None)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", not_found)
    monkeypatch.setattr(app, "_load_model", lambda *a, **k: pytest.fail("the model was loaded for bad input"))
    code, out, err = cli(["model=hf", "model.path=nobody/no-such-model-kvbench", "logger.wandb=false",
                          f"results_dir={tmp_path / 'r'}"])
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, err
    assert "model.path='nobody/no-such-model-kvbench' is not a model on the Hugging Face hub" in lines[0]


def test_pool_larger_than_the_gpu_is_refused(monkeypatch):
    # on CUDA the bound is the GPU's memory (the pool is allocated there, not virtual): checked without a GPU
    import torch

    from kvbench.run import plan
    from kvbench.run.config import RuntimeConfig
    from kvbench.errors import UserError
    from kvbench.run.model_info import PACKAGED_SHAPE, ModelShape

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=8 * 2**30))
    assert plan.machine_memory_bytes("cuda:0") == 8 * 2**30
    shape = ModelShape(*PACKAGED_SHAPE)
    plan._check_memory(RuntimeConfig(kv_memory_bytes=4 * 2**30), "cuda:0", shape, "float16")
    with pytest.raises(UserError, match=r"runtime.kv_memory_bytes=17179869184: 16.0 GiB is more than this "
                                        r"machine's 8.0 GiB of cuda:0 memory"):
        plan._check_memory(RuntimeConfig(kv_memory_bytes=16 * 2**30), "cuda:0", shape, "float16")


# issue 68 ---------------------------------------------------------------------------------------------------------
def _no_loading(monkeypatch):
    import kvbench.run.app as app

    def no_loading(*a, **k):
        raise AssertionError("the model was loaded for bad input")

    monkeypatch.setattr(app, "_load_model", no_loading)


def _one_line(code, out, err, *needles):
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, (code, out, err)
    assert len(lines) == 1 and lines[0].startswith("kvbench: error: "), err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert "Traceback" not in out + err
    return lines[0]


def test_a_user_file_registering_a_builtin_name_is_refused(cli, tmp_path, monkeypatch):
    """methods/aaa_shadow.py registering "knorm" ran as knorm (same run id); now one line names both files."""
    import importlib

    from kvbench.methods import METHODS

    METHODS.names()  # the built-ins registered first
    (tmp_path / "shadow_pkg").mkdir()
    (tmp_path / "shadow_pkg" / "__init__.py").write_text("")
    (tmp_path / "shadow_pkg" / "aaa_shadow.py").write_text(
        "from dataclasses import dataclass\nfrom kvbench.methods import ScorerMethod, register_method\n"
        "@register_method('knorm')\n@dataclass\nclass Shadow(ScorerMethod):\n"
        "    def score(self, obs):\n        return obs.keys.norm(dim=-1)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    _no_loading(monkeypatch)
    try:
        importlib.import_module("shadow_pkg.aaa_shadow")
        code, out, err = cli(["method=knorm", "budget=64", "logger.wandb=false", f"results_dir={tmp_path / 'r'}"])
    finally:
        METHODS._clashes.pop("knorm", None)
        sys.modules.pop("shadow_pkg.aaa_shadow", None)
    _one_line(code, out, err, "method 'knorm' is registered twice", str(tmp_path / "shadow_pkg" / "aaa_shadow.py"),
              os.path.join("methods", "knorm.py"))
    assert not (tmp_path / "r").exists()


def test_a_registered_method_without_its_yaml_names_the_yaml_to_create(cli, tmp_path, monkeypatch):
    """A user's method file registered without conf/method/<name>.yaml got "unknown method"; now one line says the
    YAML is missing and names the path to create (and the file that registers the method)."""
    from kvbench.methods import METHODS

    monkeypatch.syspath_prepend(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    _no_loading(monkeypatch)
    try:
        METHODS.names()
        import tests.methods.user_method  # noqa: F401  (registers my_knorm; conf/method/my_knorm.yaml does not exist)
        code, out, err = cli(["method=my_knorm", "budget=64", "logger.wandb=false", f"results_dir={tmp_path / 'r'}"])
    finally:
        METHODS._items.pop("my_knorm", None)
        sys.modules.pop("tests.methods.user_method", None)
    _one_line(code, out, err, "method 'my_knorm'", "has no YAML: create",
              os.path.join("conf", "method", "my_knorm.yaml"), os.path.join("tests", "methods", "user_method.py"))
    assert not (tmp_path / "r").exists()


INHERITED_OPTION_CASES = [  # a method's options are its dataclass's fields, whatever its YAML lists
    (["method=knorm", "budget=64", "method.decodee=evict"],
     ("unknown option method.decodee for method 'knorm'; valid options are", "interval", "did you mean decode?")),
    (["method=knorm", "budget=64", "method.decode=interval"], "method 'knorm' decode=interval needs method.interval"),
    (["method=snapkv", "budget=64", "method.decode=interval", "method.interval=0"], "invalid snapkv.interval=0"),
    (["method=kivi", "method.bitz=2"], "unknown option method.bitz for codec 'kivi'; valid options are bits"),
]


@pytest.mark.parametrize("args,needles", INHERITED_OPTION_CASES, ids=[" ".join(c[0]) for c in INHERITED_OPTION_CASES])
def test_method_options_are_the_dataclass_fields(cli, tmp_path, monkeypatch, args, needles):
    _no_loading(monkeypatch)
    code, out, err = cli([*args, "logger.wandb=false", f"results_dir={tmp_path / 'r'}"])
    _one_line(code, out, err, *((needles,) if isinstance(needles, str) else needles))
    assert not (tmp_path / "r").exists()


KVZAP_FIXTURE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "kvzap_tiny", "mlp")


def _surrogate_variant(tmp_path, name, spoil):
    import shutil

    folder = tmp_path / name
    shutil.copytree(KVZAP_FIXTURE, folder)
    spoil(folder)
    return str(folder)


def _nan_weights(folder):
    from safetensors.torch import load_file, save_file

    weights = load_file(str(folder / "model.safetensors"))
    first = sorted(weights)[0]
    weights[first] = weights[first].clone()
    weights[first].view(-1)[0] = float("nan")
    save_file(weights, str(folder / "model.safetensors"))


KVZAP_CASES = {  # name -> (spoil the fixture's copy, or None for a path as given; the line must contain)
    "nan weights": (_nan_weights, "holds NaN or inf; retrain it"),
    "truncated": (lambda f: (f / "model.safetensors").write_bytes((f / "model.safetensors").read_bytes()[:100]),
                  "is not in the hub's format"),
    "corrupt config": (lambda f: (f / "config.json").write_text("{"), "is not in the hub's format"),
    "no config": (lambda f: (f / "config.json").unlink(), "is not in the hub's format"),
    "wrong dims": (lambda f: None, "does not fit the model's (hidden_size, kv_heads, layers)=(?, 3, 30)"),
    "missing": (None, "no such folder, and not a hub id"),
    "offline hub id": ("nvidia/KVzap-mlp-NoSuchModel", "cannot load the kvzap surrogate 'nvidia/KVzap-mlp-NoSuchModel'"),
}


@pytest.mark.parametrize("case", list(KVZAP_CASES))
def test_a_bad_kvzap_surrogate_is_refused_before_the_model_loads(cli, tmp_path, monkeypatch, case):
    """Surrogate faults ended as exit 1 after the load (a NaN surrogate ran): one line, exit 2, nothing loaded."""
    spoil, needle = KVZAP_CASES[case]
    if spoil is None:
        path = str(tmp_path / "no-such-surrogate")
    elif isinstance(spoil, str):
        path = spoil
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    else:
        path = _surrogate_variant(tmp_path, "surrogate", spoil)
    _no_loading(monkeypatch)
    code, out, err = cli(["method=kvzap", f"method.path={path}", "compression_ratio=0.5", "logger.wandb=false",
                          f"results_dir={tmp_path / 'r'}"])
    _one_line(code, out, err, needle)
    assert not (tmp_path / "r").exists()


TRAIN_KVZAP_CASES = [
    (["--n-tokens", "0"], "invalid --n-tokens 0: expected an integer >= 1"),
    (["--n-texts", "0"], "invalid --n-texts 0: expected an integer >= 1"),
    (["--batch-size", "0"], "invalid --batch-size 0: expected an integer >= 1"),
    (["--hidden-dim", "0"], "invalid --hidden-dim 0: expected an integer >= 1"),
    (["--max-epochs", "0"], "invalid --max-epochs 0: expected an integer >= 1"),
    (["--lr", "nan"], "invalid --lr nan: expected a positive finite number"),
    (["--lr", "-1"], "invalid --lr -1.0: expected a positive finite number"),
    (["--min-tokens", "700", "--max-tokens", "600"], "invalid --min-tokens 700: above --max-tokens 600"),
    (["--n-tokens", "400"], "invalid --n-tokens 400: must be below --min-tokens 400"),
    (["--dtype", "int3"], "invalid --dtype 'int3': choices are float32, bfloat16, float16"),
    (["--output-dir", "{file}"], "is a file; expected a folder"),
]


@pytest.mark.parametrize("args,needle", TRAIN_KVZAP_CASES, ids=[" ".join(c[0]) for c in TRAIN_KVZAP_CASES])
def test_train_kvzap_refuses_degenerate_arguments_before_the_model_loads(tmp_path, monkeypatch, capsys, args, needle):
    """`--n-tokens 0` wrote NaN surrogates with exit 0; `--output-dir FILE` ended in a traceback."""
    from kvbench.methods import kvzap_train

    def no_loading(*a, **k):
        raise AssertionError("the model was loaded for bad input")

    monkeypatch.setattr(kvzap_train, "load_model", no_loading)
    (tmp_path / "afile").write_text("x")
    args = [a.format(file=tmp_path / "afile") for a in args]
    out_dir = [] if "--output-dir" in args else ["--output-dir", str(tmp_path / "out")]
    code = kvzap_train.main([*args, *out_dir])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("kvbench-train-kvzap: error: "), err
    assert needle in lines[0], (needle, lines[0])
    assert not (tmp_path / "out").exists()


KNOB_CASES = [  # issue 68, item 10: the line names the knob the user set, a threshold is finite
    (["method=quest", "budget=64", "method.evict=snapkv", "method.evict_budget=-5"],
     "invalid method.evict_budget=-5: expected an integer >= 1 or null"),
    (["method=adakv", "budget=64", "+method.base_options.nonsense=1"],
     "unknown option method.base_options.nonsense for method 'snapkv'"),
    (["method=dms", "method.threshold=-4", "+method.base_options.nonsense=1"],
     "unknown option method.base_options.nonsense for method 'kvzap'"),
    (["method=quest", "budget=64", "method.evict=snapkv", "method.evict_budget=64",
      "+method.evict_options.nonsense=1"], "unknown option method.evict_options.nonsense for method 'snapkv'"),
    (["method=dms", "method.threshold=inf"], "invalid method.threshold=inf: expected a finite number"),
    # a value holding ':' is quoted whole, the validator's reason after it (no message cut at a colon)
    (["method=kvcrush", "budget=64", "method.anchor=a:b"],
     "invalid kvcrush.anchor='a:b': choose one of random, zeros, ones, mean"),
    (["quant=kivi", "quant.key_axis=a:b"], "key_axis must be 'channel' or 'token', got 'a:b'"),
    (["task=scbench", "task.mode=a:b:c"], "invalid task.mode='a:b:c': choices are multi_turn, multi_request"),
    (["method=dms", "method.threshold=-inf"], "invalid method.threshold=-inf: expected a finite number"),
    (["method=dms", "method.base=kvzap", "method.threshold=inf"],
     "invalid method.threshold=inf: expected a finite number"),
]


@pytest.mark.parametrize("args,needle", KNOB_CASES, ids=[" ".join(c[0]) for c in KNOB_CASES])
def test_the_line_names_the_knob_set(cli, tmp_path, monkeypatch, args, needle):
    _no_loading(monkeypatch)
    code, out, err = cli([*args, "logger.wandb=false", f"results_dir={tmp_path / 'r'}"])
    _one_line(code, out, err, needle)
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("extra,composes", [([], 1), (["hydra.mode=RUN"], 2), (["--config-dir", CONF_DIR], 2)],
                         ids=["flags", "hydra.mode named", "another config dir"])
def test_the_run_mode_comes_from_the_flags_without_a_probe_compose(cli, tmp_path, monkeypatch, extra, composes):
    """Hydra composed each command's config twice (once only to read hydra.mode); kvbench.commands.cli's
    mode_from_the_flags leaves the probe out unless the command line names hydra.mode or another config: the same
    line and exit code either way."""
    from hydra._internal.hydra import Hydra

    calls = []
    compose_config = Hydra.compose_config

    def counted(self, *a, **k):
        calls.append(k.get("run_mode"))
        return compose_config(self, *a, **k)

    monkeypatch.setattr(Hydra, "compose_config", counted)
    _no_loading(monkeypatch)
    code, out, err = cli([*extra, "seed=-1", "logger.wandb=false", f"results_dir={tmp_path / 'r'}"])
    _one_line(code, out, err, "invalid seed=-1")
    assert len(calls) == composes, calls
    assert Hydra.get_mode.__qualname__ == "Hydra.get_mode"  # Hydra's probe is back after the command


def test_a_sweeps_jobs_are_composed_once_each_and_all_before_any_is_planned(cli, tmp_path, monkeypatch):
    """Hydra's check that every job composes and kvbench's plan of every job composed each job twice; now once,
    and still every job before the first is planned: job 2's composition error is the one reported, not job 1's
    plan error."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    calls = []
    load = ConfigLoaderImpl.load_sweep_config

    def counted(self, master_config, sweep_overrides):
        calls.append(tuple(sweep_overrides))
        return load(self, master_config, sweep_overrides)

    monkeypatch.setattr(ConfigLoaderImpl, "load_sweep_config", counted)
    _no_loading(monkeypatch)
    code, out, err = cli(["-m", "method=streaming_llm", "budget=64,-5", "logger.wandb=false",
                          f"results_dir={tmp_path / 'r'}"])
    _one_line(code, out, err, "invalid budget=-5")
    assert sorted(o for job in calls for o in job if o.startswith("budget=")) == ["budget=-5", "budget=64"], calls
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)  # set by the first command (run_cli), as in a process
    code, out, err = cli(["-m", "budget=-5,abc", "logger.wandb=false", f"results_dir={tmp_path / 'r'}"])
    _one_line(code, out, err, "invalid budget='abc'")


def test_no_config_sets_hydra_mode():
    """mode_from_the_flags (kvbench.commands.cli) rests on this: no YAML in conf/ sets hydra.mode, so Hydra's probe
    would find none and go by the flags."""
    import yaml

    def modes(node, path=()):
        if isinstance(node, dict):
            for key, value in node.items():
                here = (*path, *str(key).split("."))
                if here[-2:] == ("hydra", "mode"):
                    yield ".".join(here)
                yield from modes(value, here)

    found, files = [], 0
    for root, _, names in os.walk(CONF_DIR):
        for name in names:
            if name.endswith(".yaml"):
                files += 1
                text = open(os.path.join(root, name)).read()
                package_hydra = "@package hydra" in text.splitlines()[0] if text else False
                for doc in yaml.safe_load_all(text):
                    found += [f"{name}: {m}" for m in modes({"hydra": doc} if package_hydra else doc)]
    assert files > 50 and not found, found
    assert list(modes({"hydra": {"mode": "MULTIRUN"}})) == ["hydra.mode"]  # the scan sees one
    assert list(modes({"hydra.mode": "RUN"})) == ["hydra.mode"]


def test_a_run_another_worker_is_running_does_not_exit_0(cli, tmp_path, monkeypatch):
    """A second `python -m kvbench` of a run claimed by a live worker printed "skipping" and exited 0 with no
    result; now it exits 1 with one line saying where the result will be."""
    from kvbench.run.spec import hashable_config
    from kvbench.store.claims import claim_run
    from kvbench.store.naming import run_id_for
    from tests.harness_fakes import compose

    _no_loading(monkeypatch)
    args = ["budget=64", "logger.wandb=false", f"results_dir={tmp_path / 'r'}"]
    run_dir = tmp_path / "r" / run_id_for(hashable_config(compose(args)))
    claim, _ = claim_run(str(run_dir))  # the other worker, alive (this process) and running it
    try:
        code, out, err = cli(args)
    finally:
        claim.release()
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 1, (code, out, err)
    assert len(lines) == 1 and "is being run by pid" in lines[0] and "not run here" in lines[0], err
    assert str(run_dir) in lines[0]
    assert not (run_dir / "metrics.json").exists()


def test_truncated_model_weights_are_refused_before_the_load(cli, tmp_path, monkeypatch, tiny_llama_dir):
    """A model.safetensors cut short (a copy or download interrupted) was found only by the load."""
    import shutil

    folder = tmp_path / "cut"
    shutil.copytree(tiny_llama_dir, folder)
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) - 1000])
    _no_loading(monkeypatch)
    code, out, err = cli(["model=hf", f"model.path={folder}", "logger.wandb=false", f"results_dir={tmp_path / 'r'}"])
    _one_line(code, out, err, f"{str(weights)!r} is truncated: its header describes")


def _scbench_folder(tmp_path, name, files):
    """A task.data_dir holding SCBench files in the hub's format: {relative path: [rows]} (a row given as text is
    written as is)."""
    root = tmp_path / name
    for rel, rows in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(root)


GOOD_ROW = {"id": 0, "context": "c", "multi_turns": [{"input": "q", "answer": "a"}]}
SCBENCH_DATA_CASES = {  # name -> (files, extra overrides, the line must contain)
    "bad row past row 50": ({"scbench_kv.jsonl": [GOOD_ROW] * 59 + [{"id": 59, "context": "c"}]}, ["task.limit=null"],
                            "scbench_kv.jsonl, row 60: no 'multi_turns' field"),
    "bad row in a second file": ({"scbench_kv/part-0.jsonl": [GOOD_ROW],
                                  "scbench_kv/part-1.jsonl": [{**GOOD_ROW, "context": 5}]}, [],
                                 "part-1.jsonl, row 1: field 'context' is not text"),
    "lone surrogate": ({"scbench_kv.jsonl": ['{"id": 0, "context": "c\\ud800", "multi_turns": '
                                             '[{"input": "q", "answer": "a"}]}']}, [],
                       "field 'context' holds a lone surrogate character (U+D800) at character 1"),
    "empty question": ({"scbench_kv.jsonl": [{**GOOD_ROW, "multi_turns": [{"input": " ", "answer": "a"}]}]},
                       ["task.mode=multi_request"], "multi_turns[0]: field 'input' is empty"),
}


@pytest.mark.parametrize("case", list(SCBENCH_DATA_CASES))
def test_scbench_hub_rows_are_all_checked_before_the_load(cli, tmp_path, monkeypatch, case):
    files, extra, needle = SCBENCH_DATA_CASES[case]
    data_dir = _scbench_folder(tmp_path, "scb", files)
    _no_loading(monkeypatch)
    code, out, err = cli(["task=scbench", "task.source=hub", f"task.data_dir={data_dir}", "task.tasks=[kv]", *extra,
                          "logger.wandb=false", f"results_dir={tmp_path / 'r'}"])
    _one_line(code, out, err, needle)


def test_a_limit_reads_and_checks_only_its_rows(tmp_path):
    from kvbench.data import scbench as sd

    data_dir = _scbench_folder(tmp_path, "scb", {"scbench_kv.jsonl": [GOOD_ROW, {"id": 1, "context": "c"}]})
    sd.check_file(data_dir, "scbench_kv", limit=1)  # row 2 is never read
    with pytest.raises(ValueError, match="row 2: no 'multi_turns' field"):
        sd.check_file(data_dir, "scbench_kv")


GENERATED_SCBENCH_CASES = [  # refused only after the load (task.turns=100000: 4 GB and 242 s first)
    (["task.turns=100000"], "invalid task.length=4096: scbench_kv's 100000 turns generate up to"),
    (["task.length=512", "task.tasks=[kv]"], "invalid task.length=512: scbench_kv's 5 turns generate up to 750"),
    # the turns' prompts count too (a token per word): 750 generated fit 800, the questions do not
    (["task.length=800", "task.tasks=[kv]"],
     "invalid task.length=800: a generated scbench_kv sample with 5 turns needs at least 827 tokens"),
    (["task.length=300", "task.tasks=[vt]", "task.mode=multi_request"],
     "invalid task.length=300: a generated scbench_vt sample with 5 turns needs at least"),
]


@pytest.mark.parametrize("args,needle", GENERATED_SCBENCH_CASES, ids=[" ".join(c[0]) for c in GENERATED_SCBENCH_CASES])
def test_generated_scbench_too_short_for_its_turns_is_refused_before_the_load(cli, tmp_path, monkeypatch, args,
                                                                              needle):
    _no_loading(monkeypatch)
    code, out, err = cli(["task=scbench", *args, "logger.wandb=false", f"results_dir={tmp_path / 'r'}"])
    _one_line(code, out, err, needle)


def test_every_job_of_a_sweep_is_checked_before_job_1_runs(cli, tmp_path, monkeypatch):
    """`-m` over a good surrogate and a NaN one ran job 1 (loading the model) before refusing job 2."""
    from kvbench.methods.kvzap_surrogate import KVzapSurrogate

    good = tmp_path / "good"
    KVzapSurrogate(576, 3, 30, 8).save(good)  # fits the packaged SmolLM2 (hidden 576, 3 kv-heads, 30 layers)
    bad = _surrogate_variant(tmp_path, "nan", _nan_weights)
    _no_loading(monkeypatch)
    code, out, err = cli(["-m", "method=kvzap", f"method.path={good},{bad}", "compression_ratio=0.5",
                          "logger.wandb=false", f"results_dir={tmp_path / 'r'}"])
    _one_line(code, out, err, "holds NaN or inf")
    assert not (tmp_path / "r").exists() or not [p for p in (tmp_path / "r").iterdir() if p.is_dir()]

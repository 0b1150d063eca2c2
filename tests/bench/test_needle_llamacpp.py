"""bench/needle_llamacpp.py: the llama.cpp worker decodes greedily to a stop id (a scripted fake llama_cpp), and the
front door refuses a missing --gguf / --llamacpp-python in one line."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "needle_llamacpp.py"

FAKE = '''
import ctypes
__version__ = "fake"
NEXT = {5: 7, 7: 9, 9: 2}  # last token -> the argmax the fake model gives; 2 is the stop id
class Llama:
    def __init__(self, model_path, n_ctx, **kw):
        self.ids, self.n_ctx = [], n_ctx
    @property
    def n_tokens(self):
        return len(self.ids)
    def n_vocab(self):
        return 16
    @property
    def _ctx(self):  # llama.cpp's context: get_logits() points at the last position's logits, [vocab]
        row = (ctypes.c_float * 16)()
        row[NEXT.get(self.ids[-1], 3)] = 1.0
        self._row = row  # kept alive while the worker reads it
        return type("Ctx", (), {"get_logits": lambda _: ctypes.cast(row, ctypes.POINTER(ctypes.c_float))})()
    def eval(self, tokens):
        assert len(self.ids) + len(tokens) <= self.n_ctx
        self.ids += list(tokens)
    def detokenize(self, tokens):
        return " ".join(map(str, tokens)).encode()
'''


def _worker(tmp_path, ids, stops, limit):
    (tmp_path / "llama_cpp.py").write_text(FAKE)
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"gguf": "x.gguf", "token_ids": ids, "stop_ids": stops, "max_new_tokens": limit,
                               "threads": 1}))
    env = {"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, str(BENCH), "--llamacpp-worker", "--job", str(job)], capture_output=True,
                          text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_worker_decodes_greedily_to_the_stop_id(tmp_path):
    res = _worker(tmp_path, [1, 4, 5], [2], 32)
    assert res["prompt_tokens"] == 3 and res["answer"] == "7 9"
    assert res["generated_tokens"] == 3 and res["decode_steps"] == 2  # 7 from the prefill, 9 and 2 decoded
    assert res["peak_rss_mb"] > 0


def test_worker_stops_at_max_new_tokens(tmp_path):
    res = _worker(tmp_path, [5], [], 2)
    assert res["answer"] == "7 9" and res["generated_tokens"] == 2 and res["decode_steps"] == 1


def test_missing_arguments_exit_2_in_one_line():
    proc = subprocess.run([sys.executable, str(BENCH), "--gguf", "x.gguf"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "--llamacpp-python" in proc.stderr.strip().splitlines()[-1]

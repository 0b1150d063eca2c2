"""`fastkvzip`: Fast KVzip (Kim, Han, Yun, NAVER AI Lab, arXiv 2601.17668; code Janghyun1230/FastKVzip; kvpress
`FastKVzipPress`): small per-layer gates trained on KVzip's scores predict each token's importance from its attention
input alone, so no reconstruction pass runs.

Gate of a layer (kvpress FastKVzipGate): from the token's attention input h, per kv-head, queries q = RMSNorm(W_q h +
b_q) [groups, 16] and a key k = RMSNorm(W_k h) [16]; logit_g = <k, q_g> / 4 + b_g, and against the gate's `sink`
learned keys k_s: score = mean_g 1 / (1 + sum_s exp(<k_s, q_g> / 4 - logit_g)), in (0, 1). Scored once per token as it
arrives (kvpress scores the prefill). Once the prompt is in (prefill_mode=streaming with a budget: after every
chunk, not in kvpress), the first `n_sink` tokens and the last
int(prompt x window_ratio) (`window_size` from 32,000 tokens on) score 1.0 (kvpress; note its slice: a window of 0,
a prompt under 50 tokens, sets every score to 1.0, kept here as kvpress does), and the budget is chosen over all
layers and kv-heads jointly (layerwise=false, kvpress's default, as kvzip) or per layer (layerwise=true).

Gates (`path`): kvpress's file format, a torch .pt holding {"module": [one state dict per layer]} named
`<model folder name, lower case>/q<query heads per kv-head>_dim16_sink16.pt` in the hub repository Jang-Hyun/Fast-KVzip
(gates for Qwen3 and Llama-3 models, see there); path=null loads that file for the engine's model; a local .pt
otherwise. The packaged SmolLM2 has none.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Optional

import torch
import torch.nn.functional as F
from torch import nn

from kvbench.errors import UserError
from kvbench.methods.base import Method, register_method
from kvbench.methods.checks import check_bool, check_float, check_int
from kvbench.methods.eviction import EvictionMethod
from kvbench.methods.selection import gather_aligned, top_tokens_in_layer
from kvbench.runtime.contract import Observation

HUB_REPO = "Jang-Hyun/Fast-KVzip"


class FastKVzipGate(nn.Module):
    """kvpress FastKVzipGate for one layer: hidden [N, E] -> scores [H, N]."""

    def __init__(self, input_dim: int, nhead: int, ngroup: int, output_dim: int = 16, sink: int = 16):
        super().__init__()
        self.nhead, self.ngroup, self.output_dim = nhead, ngroup, output_dim
        self.q_proj = nn.Linear(input_dim, nhead * ngroup * output_dim, bias=True)
        self.k_proj = nn.Linear(input_dim, nhead * output_dim, bias=False)
        self.q_norm = RMSNorm(output_dim)
        self.k_norm = RMSNorm(output_dim)
        self.k_base = nn.Parameter(torch.zeros([nhead, 1, sink, output_dim]))
        self.b = nn.Parameter(torch.zeros([nhead, 1, ngroup]))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        n = h.shape[0]
        q = self.q_norm(self.q_proj(h).view(n, self.nhead, self.ngroup, self.output_dim))  # [N, H, G, d]
        k = self.k_norm(self.k_proj(h).view(n, self.nhead, 1, self.output_dim))  # [N, H, 1, d]
        q = q.transpose(0, 1).transpose(-1, -2)  # [H, N, d, G]
        k = k.transpose(0, 1)  # [H, N, 1, d]
        d = math.sqrt(self.output_dim)
        logit = torch.matmul(k, q) / d + self.b.unsqueeze(2)  # [H, N, 1, G]
        logit_base = torch.matmul(self.k_base, q) / d  # [H, N, sink, G]
        score = 1 / (1 + torch.exp(logit_base - logit).sum(2, keepdim=True))  # [H, N, 1, G]
        return score.mean(-1).squeeze(-1)  # [H, N]


class RMSNorm(nn.Module):
    """Qwen3RMSNorm (eps 1e-6, computed in float32), as kvpress's gates use."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def gate_file(model_name: str, num_attention_heads: int, num_kv_heads: int) -> str:
    """kvpress's name of a model's gate file in Jang-Hyun/Fast-KVzip (get_gate_id)."""
    return f"{model_name.rstrip('/').split('/')[-1].lower()}/q{num_attention_heads // num_kv_heads}_dim16_sink16.pt"


def load_gates(path: str) -> list[FastKVzipGate]:
    """Gates from a .pt in kvpress's format ({"module": [state dict per layer]}); the sink count from the name."""
    try:
        weights = torch.load(path, map_location="cpu", weights_only=False)["module"]
        sd = weights[0]
        group_out, input_dim = sd["q_proj.weight"].shape
        head_out = sd["k_proj.weight"].shape[0]
        out = sd["q_norm.weight"].shape[-1]
        m = re.search(r"sink(\d+)", Path(path).name)
        gates = []
        for w in weights:
            gate = FastKVzipGate(input_dim, head_out // out, group_out // head_out, out, int(m.group(1)) if m else 0)
            gate.load_state_dict(w)
            gates.append(gate.eval())
    except (OSError, KeyError, IndexError, RuntimeError, TypeError) as exc:
        raise UserError(f"Fast KVzip gates {path!r} are not in kvpress's format (a .pt with module = [state dict "
                        f"per layer]): {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    return gates


@register_method("fastkvzip")
@dataclass
class FastKVzip(EvictionMethod, Method):
    """Gate scores of each token's attention input; the budget over all layers and kv-heads (or per layer)."""

    DECODE_POLICIES: ClassVar[tuple[str, ...]] = ("none",)
    reads_hidden_states: ClassVar[bool] = True
    decode: str = "none"
    layerwise: bool = False
    n_sink: int = 4
    window_size: int = 4096
    window_ratio: float = 0.02
    path: Optional[str] = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_bool(self.name, "layerwise", self.layerwise)
        check_int(self.name, "n_sink", self.n_sink, 0)
        check_int(self.name, "window_size", self.window_size, 0)
        check_float(self.name, "window_ratio", self.window_ratio, 0.0, 1.0)
        if self.path is not None and not isinstance(self.path, str):
            raise UserError(f"invalid fastkvzip.path={self.path!r}: expected a .pt file")
        self.gates: Optional[list[FastKVzipGate]] = None
        self.engine: Any = None
        self._held: dict[int, int] = {}  # slot -> tokens of its next chunk kept uncompressed (a question)

    @property
    def budget_scope(self) -> str:  # type: ignore[override]
        return "layer" if self.layerwise else "sequence"

    def tensor_parallel_refusal(self) -> str | None:
        return "the gates score every kv-head of a layer from the full hidden state"

    def bind_engine(self, engine: Any) -> None:
        """Load the gates (path, or kvpress's file for the engine's model from the hub) and check their shapes."""
        model, cfg = engine.model, engine.model.config
        if len(engine.cache.method_layers) != engine.cache.num_layers:
            raise UserError("fastkvzip chooses its budget over every layer: not supported for a model with "
                            "sliding-window layers")
        path = self.path
        if path is None:
            name = getattr(model, "name_or_path", None)
            if not name:
                raise UserError("fastkvzip: no gates are published for the packaged model; give a .pt in kvpress's "
                                "format with method.path")
            try:
                from huggingface_hub import hf_hub_download

                path = hf_hub_download(HUB_REPO, gate_file(name, cfg.num_heads, cfg.num_kv_heads))
            except Exception as exc:  # offline, or no gates for this model
                raise UserError(f"cannot load Fast KVzip's gates for {name!r} from {HUB_REPO} "
                                f"({type(exc).__name__}); give a local .pt with method.path") from None
        gates = load_gates(path)
        got = (len(gates), gates[0].nhead, gates[0].q_proj.in_features)
        want = (cfg.num_layers, cfg.num_kv_heads, cfg.hidden_size)
        if got != want:
            raise UserError(f"Fast KVzip gates {path!r} (layers, kv_heads, input_dim)={got} do not fit the model's "
                            f"{want}")
        self.gates, self.engine = gates, engine

    def observe(self, obs: Observation) -> None:
        """Score this step's tokens by the layer's gate and place them at their slots in state["scores"]."""
        if obs.phase != "prefill":
            return
        if self.gates is None:
            raise RuntimeError("fastkvzip: the engine did not call bind_engine")
        h = obs.hidden_states  # [Q, E]
        gate = self.gates[obs.layer].to(h.device, dtype=h.dtype)
        with torch.no_grad():
            s = gate(h).float()  # [H, Q]
        Q = s.shape[1]
        lengths = obs.lengths.to(s.device)  # [H]: the step's tokens are each table's last Q slots
        T = int(lengths.max())
        st = self.state(obs.slot, obs.layer)
        acc = st.get("scores")
        acc = torch.zeros(s.shape[0], T, device=s.device) if acc is None else F.pad(acc, (0, max(0, T - acc.shape[-1])))
        idx = lengths[:, None] - Q + torch.arange(Q, device=s.device)[None, :]
        st["scores"] = acc[:, :T].scatter(1, idx, s)

    def evict_prefill(self, obs: Observation, budget: int) -> None:
        pass  # after the step, over every layer: after_prefill_chunk

    def evict_decode(self, obs: Observation, budget: int) -> None:
        pass  # decode=none

    def _record_kept(self, obs: Observation) -> None:
        pass  # recorded in after_prefill_chunk, once every layer is compressed

    def after_prefill_chunk(self, slot: int, token_ids: list[int], start_pos: int, last_chunk: bool) -> None:
        """The engine's hook after a prefill step: at the prompt's end, sinks and window to 1.0, then the budget."""
        held = self._held.pop(slot, 0)
        if held == len(token_ids):  # a question kept uncompressed: never evicted
            return
        ratio = self.compression_ratio
        if not (last_chunk or (self.prefill_mode == "streaming" and ratio is None)):
            return  # a compression ratio is a share of the whole prompt: evict once it is in
        cache = self.engine.cache
        L, H = cache.num_layers, cache.num_kv_heads
        ctx_len = int(cache.tokens_seen[slot])
        window = int(ctx_len * self.window_ratio) if ctx_len < 32000 else self.window_size
        budget = self.budget if ratio is None else max(1, int(ctx_len * (1.0 - ratio)))
        per_layer = []
        for layer in range(L):
            _, _, pos = cache.gather(layer, slot)  # [H, T] original positions (-1: empty slot)
            s = self.state(slot, layer)["scores"].clone()  # [H, T] the gates' scores by slot
            s = F.pad(s, (0, max(0, pos.shape[1] - s.shape[1])))[:, : pos.shape[1]]
            s = s.masked_fill((pos >= 0) & (pos < self.n_sink), 1.0)
            # the last `window` tokens; kvpress's slice [-0:] makes a window of 0 set every score (kept as kvpress)
            s = s.masked_fill((pos >= ctx_len - window) if window > 0 else (pos >= 0), 1.0)
            per_layer.append((s, cache.lengths[slot, layer]))
        if self.layerwise:
            for layer, (s, lengths) in enumerate(per_layer):
                if int(lengths.sum()) > H * budget:
                    self._keep(slot, layer, top_tokens_in_layer(s, H * budget, lengths))
        else:
            lengths = torch.stack([n for _, n in per_layer])  # [L, H]
            if int(lengths.sum()) > L * H * budget:
                T = max(s.shape[1] for s, _ in per_layer)
                s = torch.stack([F.pad(x, (0, T - x.shape[1])) for x, _ in per_layer])  # [L, H, T]
                keep = top_tokens_in_layer(s.view(L * H, T), L * H * budget, lengths.view(-1)).view(L, H, -1)
                for layer in range(L):
                    k = keep[layer]
                    self._keep(slot, layer, k[:, : max(1, int((k >= 0).sum(-1).max()))])
        if last_chunk:
            for layer in range(L):
                self.record_kept(cache, slot, layer)

    def keep_uncompressed(self, slot: int, num_tokens: int) -> None:
        """The next chunk of `slot` stays uncompressed (the query-agnostic protocol's question)."""
        self._held[slot] = int(num_tokens)
        super().keep_uncompressed(slot, num_tokens)

    def on_sequence_end(self, slot: int) -> None:
        self._held.pop(slot, None)
        super().on_sequence_end(slot)

    def _keep(self, slot: int, layer: int, keep: torch.Tensor) -> None:
        self.engine.cache.keep_tokens(layer, slot, keep)
        st = self.state(slot, layer)
        st["scores"] = gather_aligned(st["scores"], keep)

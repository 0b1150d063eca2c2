"""`kvzap`: KVzap (Jegou et al., 2026, arXiv:2601.07891; kvpress KVzapPress), a surrogate of KVzip+ on the hidden
states: a per-layer linear map or 2-layer GELU MLP from each token's attention input (the layer's normed hidden
state) to one score per kv-head, the log of its predicted KVzip+ score. Scored once per token as it arrives, so it
works while decoding too.

The board runs it under the threshold rule (kvpress `kvzap_linear` / `kvzap_mlp` = DMSPress(KVzapPress)):
`method=dms method.base=kvzap +method.base_options.surrogate=linear method.threshold=-4`. Alone it is a plain scorer
(`method=kvzap compression_ratio=0.5`: kvpress's `kvzap_mlp_head`; under adakv: `kvzap_mlp_layer`).

Surrogates (`surrogate` linear | mlp, kvpress default mlp; `path`):
  path=<hub id or folder>   the hub's format (kvpress KVzapModel.save_pretrained): config.json with input_dim,
                            output_dim, hidden_dim (null: linear), n_modules, and model.safetensors with
                            layers.<i>.weight/bias (linear) or layers.<i>.0.* and layers.<i>.2.* (MLP)
  path=null                 nvidia/KVzap-<surrogate>-<model folder name> for a hub model (kvpress's rule); for the
                            packaged model, the one kvbench-train-kvzap trained into the cache
                            ($KVBENCH_CACHE_DIR or ~/.cache/kvbench)/kvzap/<model>/<surrogate> (trained on first
                            use, announced with its time).
Weights are cast to the model's dtype, as kvpress does. Not on a model sharded by kv-head (the surrogate scores
every kv-head from the full hidden state).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import torch
import torch.nn.functional as F

from kvbench.errors import UserError
from kvbench.methods.base import register_method
from kvbench.methods.checks import check_choice
from kvbench.methods.kvzap_surrogate import SURROGATES, KVzapSurrogate, hub_id, load_surrogate, packaged_folder
from kvbench.methods.kvzap_train import ensure_packaged
from kvbench.methods.scorer import ScorerMethod
from kvbench.runtime.contract import Observation

__all__ = ["KVzap", "KVzapSurrogate", "hub_id", "load_surrogate"]

@register_method("kvzap")
@dataclass
class KVzap(ScorerMethod):
    """Scores from a surrogate of KVzip+ over the layer's attention input, one per (token, kv-head)."""

    DECODE_POLICIES: ClassVar[tuple[str, ...]] = ("none", "evict")
    reads_hidden_states: ClassVar[bool] = True
    surrogate: str = "mlp"
    path: Optional[str] = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice(self.name, "surrogate", self.surrogate, SURROGATES)
        if self.path is not None and not isinstance(self.path, str):
            raise UserError(f"invalid kvzap.path={self.path!r}: expected a hub id or a folder")
        self.net: Optional[KVzapSurrogate] = None

    def tensor_parallel_refusal(self) -> str | None:
        return "the surrogate scores every kv-head of a layer from the full hidden state"

    def preflight(self, settings: Any, model_shape: Any = None) -> None:
        """Before the model loads: the surrogate (method.path, the hub's one for model.path, or the packaged model's
        when already trained) loads, holds finite weights, is the kind asked for and fits the model's kv-heads and
        layers (its input width is checked against the hidden size once the model is loaded)."""
        path = settings.model.path
        if self.path is not None:
            net = load_surrogate(self.path)
        elif path:
            net = load_surrogate(hub_id(self.surrogate, str(path)))
        elif (packaged_folder(self.surrogate) / "config.json").exists():
            net = load_surrogate(str(packaged_folder(self.surrogate)))
        else:
            return  # the packaged model's surrogate is trained at first use (bind_engine)
        if model_shape is not None:
            self._check_fits(net, (getattr(model_shape, "hidden_size", None), model_shape.num_kv_heads,
                                   model_shape.num_layers))
        else:
            self._check_fits(net, (None, None, None))
        self._preloaded = (self.path, path, net)

    def _check_fits(self, net: KVzapSurrogate, want: tuple) -> None:
        """UserError unless the surrogate's (input_dim, output_dim, n_modules) equal `want` (None: not known yet)
        and it is the kind asked for."""
        got = (net.config["input_dim"], net.config["output_dim"], net.config["n_modules"])
        if any(w is not None and w != g for w, g in zip(want, got)):
            shown = ", ".join("?" if w is None else str(w) for w in want)
            raise UserError(f"kvzap surrogate (input_dim, output_dim, n_modules)={got} does not fit the model's "
                            f"(hidden_size, kv_heads, layers)=({shown})")
        if net.kind != self.surrogate:
            raise UserError(f"kvzap.surrogate={self.surrogate} but the surrogate loaded is {net.kind}")

    def bind_engine(self, engine: Any) -> None:
        """Load the surrogate for the engine's model (path, the hub's name for it, or the packaged model's)."""
        model = engine.model
        name = getattr(model, "name_or_path", None)
        preloaded = getattr(self, "_preloaded", None)
        if preloaded is not None and preloaded[:2] == (self.path, name):
            net = preloaded[2]  # loaded and checked by preflight, before the model
        elif self.path is not None:
            net = load_surrogate(self.path)
        elif name:
            net = load_surrogate(hub_id(self.surrogate, name))
        else:  # the packaged model: trained once into the cache
            net = ensure_packaged(model, getattr(model, "tokenizer", None), self.surrogate)
        cfg = model.config
        self._check_fits(net, (cfg.hidden_size, cfg.num_kv_heads, cfg.num_layers))
        self.net = net

    def observe(self, obs: Observation) -> None:
        """Score this step's tokens (their attention input) and place them at their slots in state["scores"]."""
        if self.net is None:
            raise RuntimeError("kvzap: the engine did not call bind_engine")
        h = obs.hidden_states  # [Q, E]
        if h is None:
            raise RuntimeError("kvzap: the runtime gave no hidden states (reads_hidden_states is set)")
        mod = self.net.layers[obs.layer].to(h.device, dtype=h.dtype)
        with torch.no_grad():
            s = mod(h).float().transpose(0, 1)  # [H, Q]
        Q = s.shape[1]
        lengths = obs.lengths.to(s.device)  # [H]: the step's tokens are each table's last Q slots
        T = int(lengths.max())
        st = self.state(obs.slot, obs.layer)
        acc = st.get("scores")
        acc = torch.zeros(s.shape[0], T, device=s.device) if acc is None else \
            F.pad(acc, (0, max(0, T - acc.shape[-1])))[:, :T]
        idx = lengths[:, None] - Q + torch.arange(Q, device=s.device)[None, :]  # [H, Q]
        st["scores"] = acc.scatter(1, idx, s)

    def score(self, obs: Observation) -> torch.Tensor:
        s = self.state(obs.slot, obs.layer)["scores"]  # [H, T'] (T' = the longest table)
        T = obs.keys.shape[1]
        return F.pad(s, (0, max(0, T - s.shape[-1])))[:, :T]

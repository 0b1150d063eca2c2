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

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Optional

import torch
import torch.nn.functional as F
from torch import nn

from kvbench.errors import UserError
from kvbench.methods.base import register_method
from kvbench.methods.checks import check_choice
from kvbench.methods.scorer import ScorerMethod
from kvbench.runtime.contract import Observation

SURROGATES = ("linear", "mlp")
PACKAGED = "smollm2-135m"  # the cache folder of the packaged model's surrogates


class KVzapSurrogate(nn.Module):
    """kvpress KVzapModel: one module per layer, hidden [N, E] -> scores [N, H] (layers = its n_modules)."""

    def __init__(self, input_dim: int, output_dim: int, n_modules: int, hidden_dim: Optional[int] = None):
        super().__init__()
        self.config = {"model_type": "kvzap", "architectures": ["KVzapModel"], "input_dim": input_dim,
                       "output_dim": output_dim, "hidden_dim": hidden_dim, "n_modules": n_modules}
        if hidden_dim is None:
            self.layers = nn.ModuleList(nn.Linear(input_dim, output_dim) for _ in range(n_modules))
        else:
            self.layers = nn.ModuleList(nn.Sequential(nn.Linear(input_dim, hidden_dim), nn.GELU(),
                                                      nn.Linear(hidden_dim, output_dim)) for _ in range(n_modules))

    @property
    def kind(self) -> str:
        return "linear" if self.config["hidden_dim"] is None else "mlp"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, L, E] -> [N, L, H] (kvpress KVzapModel.forward)."""
        return torch.stack([m(x[:, i, :]) for i, m in enumerate(self.layers)], dim=1)

    def save(self, folder: str | os.PathLike) -> None:
        """Write the hub's format: config.json + model.safetensors."""
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(self.config, indent=2))
        save_file({k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()},
                  str(folder / "model.safetensors"))


def load_surrogate(path: str) -> KVzapSurrogate:
    """A surrogate from a local folder in the hub's format, or a hub id (downloaded with huggingface_hub)."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        if path.startswith(("/", ".", "~")) or path.count("/") != 1:
            raise UserError(f"kvzap surrogate {path!r}: no such folder, and not a hub id (owner/name)")
        try:
            from huggingface_hub import snapshot_download

            folder = Path(snapshot_download(path, allow_patterns=["config.json", "*.safetensors"]))
        except Exception as exc:  # offline, gated, or no such repository
            raise UserError(f"cannot load the kvzap surrogate {path!r} from the hub ({type(exc).__name__}); give a "
                            "local folder with method.path, or train one with kvbench-train-kvzap") from None
    try:
        cfg = json.loads((folder / "config.json").read_text())
        from safetensors.torch import load_file

        weights = {}
        for f in sorted(folder.glob("*.safetensors")):
            weights.update(load_file(str(f)))
        model = KVzapSurrogate(int(cfg["input_dim"]), int(cfg["output_dim"]), int(cfg["n_modules"]),
                               None if cfg.get("hidden_dim") is None else int(cfg["hidden_dim"]))
        model.load_state_dict(weights)
    except (OSError, KeyError, ValueError, RuntimeError) as exc:
        raise UserError(f"kvzap surrogate {str(folder)!r} is not in the hub's format (config.json + "
                        f"model.safetensors): {str(exc).splitlines()[0]}") from None
    return model.eval()


def hub_id(surrogate: str, model_name: str) -> str:
    """kvpress's name for a model's published surrogate: nvidia/KVzap-<surrogate>-<last part of the model name>."""
    return f"nvidia/KVzap-{surrogate}-{model_name.rstrip('/').split('/')[-1]}"


def packaged_folder(surrogate: str) -> Path:
    from kvbench.runtime.model.loading import cache_root

    return cache_root() / "kvzap" / PACKAGED / surrogate


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

    def bind_engine(self, engine: Any) -> None:
        """Load the surrogate for the engine's model (path, the hub's name for it, or the packaged model's)."""
        model = engine.model
        if self.path is not None:
            net = load_surrogate(self.path)
        else:
            name = getattr(model, "name_or_path", None)
            if name:
                net = load_surrogate(hub_id(self.surrogate, name))
            else:  # the packaged model: trained once into the cache
                from kvbench.methods.kvzap_train import ensure_packaged

                net = ensure_packaged(model, getattr(model, "tokenizer", None), self.surrogate)
        cfg = model.config
        want = (cfg.hidden_size, cfg.num_kv_heads, cfg.num_layers)
        got = (net.config["input_dim"], net.config["output_dim"], net.config["n_modules"])
        if want != got:
            raise UserError(f"kvzap surrogate (input_dim, output_dim, n_modules)={got} does not fit the model's "
                            f"(hidden_size, kv_heads, layers)={want}")
        if net.kind != self.surrogate:
            raise UserError(f"kvzap.surrogate={self.surrogate} but the surrogate loaded is {net.kind}")
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

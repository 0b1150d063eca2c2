"""KVzap's surrogate models (kvpress KVzapModel) and their files: the hub's format, loading from a folder or the hub,
the hub's name for a model's surrogate, and the cache folder of the packaged model's."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from kvbench.errors import UserError
from kvbench.runtime.model.loading import cache_root

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
    except Exception as exc:  # a missing or corrupt config, a truncated safetensors file (SafetensorError), ...
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"kvzap surrogate {str(folder)!r} is not in the hub's format (config.json + "
                        f"model.safetensors): {first}") from None
    for name, tensor in model.state_dict().items():  # a NaN surrogate scores every token NaN: refused at load
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise UserError(f"kvzap surrogate {str(folder)!r}: weight {name!r} holds NaN or inf; retrain it "
                            f"(kvbench-train-kvzap)")
    return model.eval()


def hub_id(surrogate: str, model_name: str) -> str:
    """kvpress's name for a model's published surrogate: nvidia/KVzap-<surrogate>-<last part of the model name>."""
    return f"nvidia/KVzap-{surrogate}-{model_name.rstrip('/').split('/')[-1]}"


def packaged_folder(surrogate: str) -> Path:
    return cache_root() / "kvzap" / PACKAGED / surrogate

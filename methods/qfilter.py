"""`qfilter`: Q-Filters (Godey et al., 2025, arXiv 2503.02812; kvpress `QFilterPress`): one learned direction per
(layer, kv-head), trained offline so that its projection of a key tracks the attention that key will get; score of a
cached token = -<filter, k> over the key as cached (post-RoPE, as kvpress), the top tokens kept per kv-head. As
kvpress, the prompt is compressed once by score alone (no window, no sinks).

Filters (`path`): the hub's format, as kvpress's QFilters (huggingface_hub's PyTorchModelHubMixin) writes it:
config.json with num_layers, num_kv_heads, kv_head_dim, and model.safetensors with `q_filters` [layers, kv_heads,
head_dim]. path=null loads kvpress's name for the model's filters, nthngdy/<model folder name>_qfilt ("Meta-Llama" in
the name becomes "Llama" but for 405B, as kvpress); a hub id or a local folder in that format otherwise. There are no
published filters for the packaged SmolLM2: give a folder. Filters are cast to the model's dtype, as kvpress.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Optional

import torch

from kvbench.errors import UserError
from kvbench.methods.base import register_method
from kvbench.methods.scorer import ScorerMethod
from kvbench.runtime.contract import Observation


def hub_id(model_name: str) -> str:
    """kvpress's hub name for a model's Q-filters (QFilterPress.load_q_filters)."""
    name = model_name.rstrip("/").split("/")[-1]
    name = name if "Meta-Llama-3.1-405B" in name else name.replace("Meta-Llama", "Llama")
    return f"nthngdy/{name}_qfilt"


def save_q_filters(filters: torch.Tensor, folder: str | os.PathLike) -> None:
    """Write filters [layers, kv_heads, head_dim] in the hub's format (config.json + model.safetensors)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    L, H, D = filters.shape
    (folder / "config.json").write_text(json.dumps({"num_layers": L, "num_kv_heads": H, "kv_head_dim": D}))
    save_file({"q_filters": filters.detach().contiguous().cpu()}, str(folder / "model.safetensors"))


def load_q_filters(path: str) -> torch.Tensor:
    """Filters [layers, kv_heads, head_dim] from a folder in the hub's format, or a hub id (huggingface_hub)."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        if path.startswith(("/", ".", "~")) or path.count("/") != 1:
            raise UserError(f"qfilter filters {path!r}: no such folder, and not a hub id (owner/name)")
        try:
            from huggingface_hub import snapshot_download

            folder = Path(snapshot_download(path, allow_patterns=["config.json", "*.safetensors"]))
        except Exception as exc:  # offline, or no filters published for this model
            raise UserError(f"cannot load the Q-filters {path!r} from the hub ({type(exc).__name__}); give a local "
                            "folder in the hub's format with method.path") from None
    try:
        from safetensors.torch import load_file

        cfg = json.loads((folder / "config.json").read_text())
        filters = load_file(str(folder / "model.safetensors"))["q_filters"]
        want = (int(cfg["num_layers"]), int(cfg["num_kv_heads"]), int(cfg["kv_head_dim"]))
    except (OSError, KeyError, ValueError, RuntimeError) as exc:
        raise UserError(f"Q-filters {str(folder)!r} are not in the hub's format (config.json + model.safetensors "
                        f"with q_filters): {str(exc).splitlines()[0]}") from None
    if tuple(filters.shape) != want:
        raise UserError(f"Q-filters {str(folder)!r}: q_filters has shape {tuple(filters.shape)}, config.json says "
                        f"{want}")
    return filters


@register_method("qfilter")
@dataclass
class QFilter(ScorerMethod):
    """-<filter, key> per (layer, kv-head) with learned filters; the prompt compressed once (decode="evict": every
    step too)."""

    DECODE_POLICIES: ClassVar[tuple[str, ...]] = ("none", "evict")
    path: Optional[str] = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.path is not None and not isinstance(self.path, str):
            raise UserError(f"invalid qfilter.path={self.path!r}: expected a hub id or a folder")
        self.filters: Optional[torch.Tensor] = None  # [L, H, D]

    def bind_engine(self, engine: Any) -> None:
        """Load the filters for the engine's model (path, or kvpress's hub name for the model)."""
        model = engine.model
        path = self.path
        if path is None:
            name = getattr(model, "name_or_path", None)
            if not name:
                raise UserError("qfilter: no Q-filters are published for the packaged model; give a folder in the "
                                "hub's format with method.path")
            path = hub_id(name)
        filters = load_q_filters(path)
        cfg = model.config
        want = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
        if tuple(filters.shape) != want:
            raise UserError(f"Q-filters {path!r} (layers, kv_heads, head_dim)={tuple(filters.shape)} do not fit the "
                            f"model's {want}")
        self.filters = filters

    def tensor_parallel_refusal(self) -> str | None:
        return "the filters are indexed by the model's kv-heads, not a rank's"

    def score(self, obs: Observation) -> torch.Tensor:
        if self.filters is None:
            raise RuntimeError("qfilter: the engine did not call bind_engine")
        if obs.pre_rope:
            raise UserError("method 'qfilter' scores post-RoPE keys; it cannot run on a pre-RoPE cache")
        k = obs.keys  # [H, T, D] post-RoPE, as cached
        f = self.filters[obs.layer].to(k.device, dtype=k.dtype)  # [H, D] in the model's dtype (kvpress)
        return -(f[:, None, :] * k).sum(-1).float()  # [H, T]

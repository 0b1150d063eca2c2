"""A mixture-of-experts MLP in plain torch (GPT-OSS's): a top-k router and a loop over the experts a step hits.

    MoEMLP(router_w [X, E], router_b [X], gate_up [X, E, 2I], gate_up_b [X, 2I], down [X, I, E], down_b [X, E],
           top_k, alpha, limit)(h [N, E]) -> [N, E]

GPT-OSS's expert: gate_up's columns interleave gate (even) and up (odd); gate clamped above at `limit`, up to
[-limit, limit]; out = (up + 1) * gate * sigmoid(alpha * gate), then down. The router's softmax runs over the top-k
logits only. Correct first: one matmul pair per expert hit, no grouped kernel.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class MoEMLP:
    """GPT-OSS's MoE MLP over the flat token list."""

    def __init__(self, router_w: torch.Tensor, router_b: torch.Tensor, gate_up: torch.Tensor,
                 gate_up_b: torch.Tensor, down: torch.Tensor, down_b: torch.Tensor, top_k: int, alpha: float,
                 limit: float):
        self.router_w, self.router_b = router_w, router_b  # [X, E], [X]
        self.gate_up, self.gate_up_b = gate_up, gate_up_b  # [X, E, 2I], [X, 2I]
        self.down, self.down_b = down, down_b  # [X, I, E], [X, E]
        self.top_k, self.alpha, self.limit = top_k, alpha, limit

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.router_w, self.router_b, self.gate_up, self.gate_up_b, self.down, self.down_b

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def __call__(self, h: torch.Tensor) -> torch.Tensor:  # h [N, E] -> [N, E]
        logits = F.linear(h, self.router_w, self.router_b)  # [N, X]
        top, idx = torch.topk(logits, self.top_k, dim=-1)  # [N, k]
        weights = torch.softmax(top, dim=-1)
        out = torch.zeros_like(h)
        for x in torch.unique(idx).tolist():  # the experts this step hits
            rows, slot = torch.where(idx == x)
            gu = h[rows] @ self.gate_up[x] + self.gate_up_b[x]  # [n, 2I]
            gate = gu[..., ::2].clamp(max=self.limit)
            up = gu[..., 1::2].clamp(min=-self.limit, max=self.limit)
            y = ((up + 1) * gate * torch.sigmoid(gate * self.alpha)) @ self.down[x] + self.down_b[x]  # [n, E]
            out.index_add_(0, rows, y * weights[rows, slot, None])
        return out

"""Turning logits into tokens: greedy, temperature and top-p sampling, and the distribution they sample from
(speculative decoding compares the draft's and the target's)."""
from __future__ import annotations

import torch

from kvbench.runtime.backends.cpu.kernels import argmax_rows


def sampling_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The distribution sampling draws from: softmax(logits / temperature) over the top-p nucleus, float32 on the
    host. logits [..., V] -> probs [..., V] (unnormalised after the top-p cut; torch.multinomial normalises)."""
    probs = torch.softmax(logits.float().cpu() / temperature, dim=-1)
    if top_p < 1.0:
        sp, si = probs.sort(dim=-1, descending=True)
        keep = sp.cumsum(-1) - sp < top_p
        probs = torch.zeros_like(probs).scatter(-1, si, sp * keep)
    return probs


def sample(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator) -> list[int]:
    """logits [S, V] -> one token id per row (argmax when temperature <= 0)."""
    if temperature <= 0:
        if logits.device.type == "cpu" and logits.dtype == torch.float32:  # the C kernels' argmax (csrc/decode_ops.c)
            toks = argmax_rows(logits)
            if toks is not None:
                return toks
        return logits.argmax(dim=-1).tolist()
    return torch.multinomial(sampling_probs(logits, temperature, top_p), 1, generator=gen).squeeze(-1).tolist()

"""Logits -> probabilities with temperature / top-k / top-p, applied identically to target and drafters."""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings; temperature 0 means greedy."""

    temperature: float = 0.0
    top_k: int = 0      # 0 = off
    top_p: float = 0.0  # 0 = off

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turn logits [n, vocab] into the sampling distribution [n, vocab] (float32) for non-greedy params."""
    assert not params.greedy, 'greedy decoding uses argmax, not probabilities'
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float('-inf'))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p and params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one token per row of probs [n, vocab] -> [n]."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)

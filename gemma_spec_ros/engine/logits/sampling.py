"""Logits -> probabilities with temperature / top-k / top-p, applied identically to target and drafters."""

import torch

from ..requests import SamplingParams


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """
    Turn logits [n, vocab] into the sampling distribution [n, vocab] (float32) for non-greedy params.

    The largest logit is subtracted before dividing by the temperature, and a temperature below float32's
    smallest normal number counts as that number, so any temperature > 0, however small, gives finite
    probabilities (a tiny one approaches greedy). top_p keeps at least the most likely token.
    """
    assert not params.greedy, 'greedy decoding uses argmax, not probabilities'
    logits = logits.float()
    temperature = max(params.temperature, torch.finfo(torch.float32).tiny)
    logits = (logits - logits.max(dim=-1, keepdim=True).values) / temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float('-inf'))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p and params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        outside = mass_before >= params.top_p
        outside[..., 0] = False
        sorted_probs = sorted_probs.masked_fill(outside, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def greedy_pick(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the argmax of logits [..., vocab] and its probability (a greedy draft's confidence), each [...]."""
    logits = logits.float()
    return logits.argmax(dim=-1), torch.softmax(logits, dim=-1).amax(dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one token per row of probs [n, vocab] -> [n]."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)

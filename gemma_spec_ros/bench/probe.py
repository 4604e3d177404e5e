"""
Forward-cost probe: target cost for 1..K+1 tokens at a real context, and one drafter step.

The Leviathan model needs c (drafter step / target step) and the verify-cost curve v(n) = t(n tokens) / t(1 token).
Each timed forward starts from a copy of the same prefilled cache, so every size sees the same context.
"""

import copy
import statistics
import time
from dataclasses import dataclass


@dataclass
class CostProbe:
    context_tokens: int
    target_forward_ms: dict[int, float]   # tokens in one target forward -> median ms
    verify_cost: dict[int, float]         # n -> t(n) / t(1)
    draft_step_ms: float                  # draft model, 1 token with cache
    assistant_step_ms: float              # Gemma 4 assistant, 1 step on the target's shared K/V
    draft_cost_ratio: dict[str, float]    # drafter -> c measured here

    def verify_cost_at(self, tokens: float) -> float:
        """v(tokens), linearly interpolated between measured sizes (clamped at the ends)."""
        sizes = sorted(self.verify_cost)
        if tokens <= sizes[0]:
            return self.verify_cost[sizes[0]]
        for low, high in zip(sizes, sizes[1:], strict=False):
            if tokens <= high:
                weight = (tokens - low) / (high - low)
                return self.verify_cost[low] * (1 - weight) + self.verify_cost[high] * weight
        return self.verify_cost[sizes[-1]]


def _timed_ms(call) -> float:
    start = time.perf_counter()
    call()
    return (time.perf_counter() - start) * 1000.0


def measure_costs(target, prompt_ids: list[int], sizes: list[int], repeats: int, draft_model=None,
                  assistant=None) -> CostProbe:
    """Median forward times over ``repeats`` interleaved rounds (sizes in one round share machine load)."""
    import torch

    if not sizes or min(sizes) < 1 or repeats < 1:
        raise ValueError('sizes must be >= 1 and repeats >= 1')
    sizes = sorted(set(sizes) | {1})
    context = torch.tensor([prompt_ids], dtype=torch.long)
    next_tokens = context[:, -max(sizes):].flip(1)  # real token ids, any content will do
    samples: dict[str, list[float]] = {str(n): [] for n in sizes} | {'draft': [], 'mtp': []}
    with torch.inference_mode():
        prefill = target(input_ids=context, use_cache=True, output_hidden_states=True, return_shared_kv_states=True)
        draft_cache = draft_model(input_ids=context, use_cache=True).past_key_values if draft_model else None
        hidden = prefill.hidden_states[-1][:, -1:]
        shared_kv = prefill.shared_kv_states
        embed = target.get_input_embeddings()
        position = torch.tensor([[context.shape[1] - 1]])
        for _ in range(repeats):
            for n in sizes:
                cache = copy.deepcopy(prefill.past_key_values)
                samples[str(n)].append(_timed_ms(
                    lambda n=n, cache=cache: target(input_ids=next_tokens[:, :n], cache=cache, use_cache=True)))
            if draft_model is not None:
                cache = copy.deepcopy(draft_cache)
                samples['draft'].append(_timed_ms(
                    lambda cache=cache: draft_model(input_ids=next_tokens[:, :1], cache=cache, use_cache=True)))
            if assistant is not None:
                samples['mtp'].append(_timed_ms(lambda: assistant(
                    inputs_embeds=torch.cat([embed(context[:, -1:]), hidden], dim=-1), position_ids=position,
                    shared_kv_states=shared_kv, use_cache=False)))
    forward_ms = {n: statistics.median(samples[str(n)]) for n in sizes}
    draft_ms = statistics.median(samples['draft']) if samples['draft'] else 0.0
    assistant_ms = statistics.median(samples['mtp']) if samples['mtp'] else 0.0
    return CostProbe(
        context_tokens=len(prompt_ids), target_forward_ms=forward_ms,
        verify_cost={n: forward_ms[n] / forward_ms[1] for n in sizes},
        draft_step_ms=draft_ms, assistant_step_ms=assistant_ms,
        draft_cost_ratio={'none': 0.0, 'ngram': 0.0, 'draft': draft_ms / forward_ms[1],
                          'mtp': assistant_ms / forward_ms[1]})

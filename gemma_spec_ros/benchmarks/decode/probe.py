"""
Forward-cost probe: target cost for 1..K+1 tokens at a real context, and one drafter step.

The Leviathan model needs c (drafter step / target step) and the verify-cost curve v(n) = t(n tokens) / t(1 token).
Each timed forward starts from the same prefilled context, so every size sees the same context. The curve is taken
twice: for transformers' forward, and for our engine's decode steps (per compile mode), whose curve is steeper
because a compiled step has little fixed cost to share; predictions for our systems use our curve. The harness
takes probe rounds between the measured generations, so the probe sees the same machine load as the systems.
"""

import copy
import statistics
import time
from dataclasses import dataclass, field


@dataclass
class CostProbe:
    context_tokens: int
    rounds: int
    target_forward_ms: dict[int, float]   # tokens in one target forward -> median ms
    verify_cost: dict[int, float]         # n -> t(n) / t(1)
    draft_step_ms: float                  # draft model, 1 token with cache
    assistant_step_ms: float              # Gemma 4 assistant, 1 step on the target's shared K/V
    draft_cost_ratio: dict[str, float]    # drafter -> c measured here
    engine_forward_ms: dict[str, dict[int, float]] = field(default_factory=dict)  # compile mode -> n -> median ms
    engine_verify_cost: dict[str, dict[int, float]] = field(default_factory=dict)  # compile mode -> n -> v(n)

    def verify_cost_at(self, tokens: float, compile_mode: str = '') -> float:
        """
        Return v(tokens) of transformers' forward, or of our decode steps in compile_mode when given.

        Linearly interpolated between measured sizes (clamped at the ends).
        """
        curve = self.engine_verify_cost[compile_mode] if compile_mode else self.verify_cost
        sizes = sorted(curve)
        if tokens <= sizes[0]:
            return curve[sizes[0]]
        for low, high in zip(sizes, sizes[1:], strict=False):
            if tokens <= high:
                weight = (tokens - low) / (high - low)
                return curve[low] * (1 - weight) + curve[high] * weight
        return curve[sizes[-1]]


def _timed_ms(call) -> float:
    start = time.perf_counter()
    call()
    return (time.perf_counter() - start) * 1000.0


class CostSampler:
    """
    Prefilled target (and drafters) on one prompt; each round times every size once.

    engines: our engines by compile mode; each round also times their verify passes (Engine.time_target_passes).
    """

    def __init__(self, target, prompt_ids: list[int], sizes: list[int], draft_model=None, assistant=None,
                 engines: dict | None = None):
        import torch

        if not sizes or min(sizes) < 1:
            raise ValueError('probe sizes must be >= 1, got {}'.format(sizes))
        self._target, self._draft_model, self._assistant = target, draft_model, assistant
        self._engines = engines or {}
        self._prompt_ids = list(prompt_ids)
        self._sizes = sorted(set(sizes) | {1})
        self._engine_samples: dict[str, dict[int, list[float]]] = {
            mode: {n: [] for n in self._sizes} for mode in self._engines}
        self._context = torch.tensor([prompt_ids], dtype=torch.long)
        self._next_tokens = self._context[:, -max(self._sizes):].flip(1)  # real token ids; content is irrelevant
        self._samples: dict[str, list[float]] = {str(n): [] for n in self._sizes} | {'draft': [], 'mtp': []}
        with torch.inference_mode():
            prefill = target(input_ids=self._context, use_cache=True, output_hidden_states=True,
                             return_shared_kv_states=True)
            self._draft_cache = (draft_model(input_ids=self._context, use_cache=True).past_key_values
                                 if draft_model is not None else None)
        self._target_cache = prefill.past_key_values
        self._hidden = prefill.hidden_states[-1][:, -1:]
        self._shared_kv = prefill.shared_kv_states
        self._position = torch.tensor([[self._context.shape[1] - 1]])

    def sample(self, rounds: int = 1) -> None:
        import torch

        embed = self._target.get_input_embeddings()
        with torch.inference_mode():
            for _ in range(rounds):
                for n in self._sizes:
                    cache = copy.deepcopy(self._target_cache)
                    self._samples[str(n)].append(_timed_ms(lambda n=n, cache=cache: self._target(
                        input_ids=self._next_tokens[:, :n], cache=cache, use_cache=True)))
                if self._draft_model is not None:
                    cache = copy.deepcopy(self._draft_cache)
                    self._samples['draft'].append(_timed_ms(lambda cache=cache: self._draft_model(
                        input_ids=self._next_tokens[:, :1], cache=cache, use_cache=True)))
                if self._assistant is not None:
                    self._samples['mtp'].append(_timed_ms(lambda: self._assistant(
                        inputs_embeds=torch.cat([embed(self._context[:, -1:]), self._hidden], dim=-1),
                        position_ids=self._position, shared_kv_states=self._shared_kv, use_cache=False)))
                for mode, engine in self._engines.items():
                    for n, seconds in engine.time_target_passes(self._prompt_ids, self._sizes).items():
                        self._engine_samples[mode][n].append(seconds * 1000.0)

    def result(self) -> CostProbe:
        """Medians of all rounds so far."""
        if not self._samples['1']:
            raise ValueError('no probe rounds taken')
        forward_ms = {n: statistics.median(self._samples[str(n)]) for n in self._sizes}
        draft_ms = statistics.median(self._samples['draft']) if self._samples['draft'] else 0.0
        assistant_ms = statistics.median(self._samples['mtp']) if self._samples['mtp'] else 0.0
        engine_ms = {mode: {n: statistics.median(times) for n, times in by_size.items()}
                     for mode, by_size in self._engine_samples.items()}
        return CostProbe(
            context_tokens=self._context.shape[1], rounds=len(self._samples['1']), target_forward_ms=forward_ms,
            verify_cost={n: forward_ms[n] / forward_ms[1] for n in self._sizes},
            draft_step_ms=draft_ms, assistant_step_ms=assistant_ms,
            draft_cost_ratio={'none': 0.0, 'ngram': 0.0, 'draft': draft_ms / forward_ms[1],
                              'mtp': assistant_ms / forward_ms[1]},
            engine_forward_ms=engine_ms,
            engine_verify_cost={mode: {n: ms[n] / ms[1] for n in self._sizes} for mode, ms in engine_ms.items()})

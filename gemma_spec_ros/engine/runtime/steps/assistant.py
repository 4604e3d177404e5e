"""
The MTP assistant's runner (FastAssistant), reading a FastCausalLM target's static cache.

One-token draft steps, and greedy rounds that unroll several steps per call (GREEDY_STEPS).
"""

import functools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from ...logits.sampling import greedy_pick
from ..model.forward import LeanAssistant, StepOutput
from ..model.weights import store_exact_half
from ..quant.quantize import Quantizer
from .runner import FastCausalLM, GraphJob, Progress, WarmupReport, _Shadowed, _stage_shadow_graphs
from .tables import INDUCTOR_MODES, _Steps, resolve_compile_mode

GREEDY_STEPS = (1, 2, 4, 8)  # MTP draft steps per call of a greedy round's step functions (FastAssistant.greedy_drafts)


def greedy_chunks(num_drafts: int) -> list[int]:
    """Return the steps per call of a greedy MTP round of num_drafts drafts: each the most GREEDY_STEPS that fit."""
    chunks = []
    while num_drafts:
        chunks.append(max(steps for steps in GREEDY_STEPS if steps <= num_drafts))
        num_drafts -= chunks[-1]
    return chunks


@functools.cache  # the adaptive controller prices every K at every decision
def greedy_calls(num_drafts: int) -> int:
    """Return the calls of a greedy MTP round of num_drafts drafts (K = 4 one, K = 5 two)."""
    return len(greedy_chunks(num_drafts))


class FastAssistant(_Shadowed):
    """
    The MTP assistant as one step function reading a FastCausalLM target's static cache.

    With inductor on CPU its matrices are stored in 16 bits where that is exact (``weights_dtype``; see
    weights.store_exact_half): its own forward is then off. Its steps are all one token, which that suits; a draft
    model's catch-up steps of two tokens ran slower so (bench figures in bench/RESULTS.md).
    """

    def __init__(self, assistant, target: FastCausalLM, compile_mode: str = 'auto', quantizer: Quantizer | None = None):
        self.target = target
        self.mode = resolve_compile_mode(compile_mode, target.lean.device)
        compiled_for_cpu = self.mode in INDUCTOR_MODES and target.lean.device.type == 'cpu'
        self.weights_dtype = store_exact_half(assistant) if compiled_for_cpu and quantizer is None else None
        # after the dtype change: it packs the weights as they are
        self.lean = LeanAssistant(assistant, target.lean, quantizer, target.row_product_max_rows)
        self.quantization = None if quantizer is None else quantizer.report
        self._steps = self._new_steps()

    def _new_steps(self) -> _Steps:
        return _Steps(self.mode, self.target.lean.device, self.target.cache.context_limit, self.lean.inlines_layers,
                      self.lean.row_product_max_rows)

    def step(self, token_ids: torch.Tensor, hidden: torch.Tensor, position: int) -> StepOutput:
        """
        One draft step at position (= the target cache length): token_ids [1, 1], hidden [1, 1, backbone].

        Returns logits [1, 1, vocab] and the hidden [1, 1, backbone] for the next step.
        """
        with self.drafting(position) as step:
            return step(token_ids, hidden)

    @contextmanager
    def drafting(self, position: int) -> Iterator[Callable[[torch.Tensor, torch.Tensor], StepOutput]]:
        """Yield the step function of one draft round at position: step(token_ids, hidden) as in step()."""
        with self._round(position) as (positions, kv_positions):
            def step(token_ids: torch.Tensor, hidden: torch.Tensor) -> StepOutput:
                logits, projected = self._steps.run((1,), self._step_function, (token_ids, hidden, positions),
                                                    kv_positions, dynamic_dims=(None, None, None))
                return StepOutput(logits, projected)
            yield step

    def greedy_drafts(self, token_ids: torch.Tensor, hidden: torch.Tensor, position: int, k: int,
                      min_confidence: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        """
        Draft k greedy tokens at position from token_ids [1, 1] and hidden [1, 1, backbone] (as step() and argmax).

        Returns the tokens [k] and the assistant's probability of each [k]. Runs GREEDY_STEPS steps per call where
        it can: each step function unrolls its steps with their argmax, so a round of K = 4 pays one call's
        overhead instead of four (and no Python between the steps). With a cut-off (min_confidence > 0) the round
        ends at its first draft under it, that draft included, as DraftRound's does: the calls after that draft's
        are not run (the drafts after it in the same call are computed and dropped).
        """
        tokens, confidences = [], []
        with self._round(position) as (positions, kv_positions):
            for size in greedy_chunks(k):
                chunk_tokens, chunk_confidences, hidden = self._steps.run(
                    ('greedy', size), lambda size=size: self._greedy_function(size), (token_ids, hidden, positions),
                    kv_positions, dynamic_dims=(None, None, None))
                tokens.append(chunk_tokens)
                confidences.append(chunk_confidences)
                token_ids = chunk_tokens[-1:].view(1, 1)
                if min_confidence:
                    low = (chunk_confidences < min_confidence).nonzero()  # one host sync per call
                    if low.numel():
                        keep = low[0, 0].item() + 1
                        tokens[-1], confidences[-1] = chunk_tokens[:keep], chunk_confidences[:keep]
                        break
        return torch.cat(tokens), torch.cat(confidences)

    @contextmanager
    def _round(self, position: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """
        Yield (positions [1], kv_positions) of a draft round at position.

        Every step of a round drafts at the same position: its tensors are set up once per round instead of once per
        step.
        """
        cache = self.target.cache
        if not 0 < position <= cache.length:
            raise ValueError('the assistant drafts at a position in 1..{} (the target cache length), got {}'.format(
                cache.length, position))
        with torch.inference_mode():
            yield (torch.tensor([position], device=self.target.lean.device),
                   cache.key_positions[:self._steps.key_length(position)])

    def _step_function(self):
        lean, cache = self.lean, self.target.cache

        def step(token_ids, hidden, positions, kv_positions):
            out = lean.step(token_ids, hidden, positions, cache, kv_positions.shape[0])
            return out.logits, out.hidden
        return step

    def _greedy_function(self, num_steps: int):
        lean, cache = self.lean, self.target.cache

        def steps(token_ids, hidden, positions, kv_positions):
            tokens, confidences = [], []
            for _ in range(num_steps):
                out = lean.step(token_ids, hidden, positions, cache, kv_positions.shape[0])
                token, confidence = greedy_pick(out.logits[0, -1])  # as DraftRound.draw's greedy draft
                tokens.append(token)
                confidences.append(confidence)
                token_ids, hidden = token.view(1, 1), out.hidden
            return torch.stack(tokens), torch.stack(confidences), hidden
        return steps

    @torch.inference_mode()
    def warmup(self, progress: Progress | None = None) -> WarmupReport:
        """Create the step variants (every key-length bucket on CUDA); the target cache is reset after."""
        report_progress = progress or (lambda message: None)
        started = time.perf_counter()
        cache, device = self.target.cache, self.target.lean.device
        for length in self._steps.key_lengths():
            cache.reset()
            cache.advance(0, max(length, 2))
            token_ids = torch.zeros((1, 1), dtype=torch.long, device=device)
            hidden = torch.zeros((1, 1, self.target.lean.hidden_size), dtype=self.target.lean.dtype, device=device)
            self.step(token_ids, hidden, cache.length)
            for size in GREEDY_STEPS:
                self.greedy_drafts(token_ids, hidden, cache.length, size)
        cache.reset()
        report_progress('warm-up: MTP assistant ({} mode, {:.1f} s)'.format(self.mode, time.perf_counter() - started))
        return WarmupReport(self.mode, self._steps.count, time.perf_counter() - started, self._steps.direct_count)

    def graph_jobs(self, role: str) -> list[GraphJob]:
        """
        List the step graphs a background warm-up builds (none unless steps compile on CPU).

        Greedy rounds first, in the order adaptive K reaches them (K = 4 is one call of 4 steps, K = 5 adds one of 1),
        then the single step that sampled rounds use.
        """
        if not self._steps.dynamic:
            return []
        sizes = sorted(GREEDY_STEPS, key=lambda size: (size != 4, size))
        jobs = [GraphJob('{} greedy x{}'.format(role, size), self, self._steps,
                         (self._steps.variant_key(('greedy', size), 1, 0),),
                         functools.partial(self._build_on_shadow, size)) for size in sizes]
        jobs.append(GraphJob('{} step'.format(role), self, self._steps, (self._steps.variant_key((1,), 1, 0),),
                             functools.partial(self._build_on_shadow, 0)))
        return jobs

    @torch.inference_mode()
    def _build_on_shadow(self, greedy_steps: int) -> int:
        """Compile the greedy call of greedy_steps steps (0: the single step) on the shadow; stage it here."""
        shadow = self.shadow()
        cache, device = shadow.target.cache, self.target.lean.device
        cache.reset()
        cache.advance(0, 2)
        token_ids = torch.zeros((1, 1), dtype=torch.long, device=device)
        hidden = torch.zeros((1, 1, self.target.lean.hidden_size), dtype=self.target.lean.dtype, device=device)
        if greedy_steps:
            shadow.greedy_drafts(token_ids, hidden, cache.length, greedy_steps)
        else:
            shadow.step(token_ids, hidden, cache.length)
        cache.reset()
        return _stage_shadow_graphs(self._steps, shadow._steps, self.target.cache, cache)

    def _give_shadow_a_cache(self, shadow: 'FastAssistant') -> None:
        shadow.target = self.target.shadow()  # the assistant reads its target's cache

"""
The decode round, written once for one goal and for many: start, first token, plan, draft, verify, accept, emit.

The single-goal loop (engine.py) and the batch scheduler (batch.py) differ only in their target passes and KV
caches: one cache and one pass per goal, or a slot per goal and one pass for all. Everything a round does per goal
around those passes is a method of Rounds, in the order a round calls them; so are the measurements every goal
adds to (the single-goal verify cost curve and the lifetime counters: status() reads them).
"""

import threading
import time

import torch

from ..control import Decision, SpeculationController, TargetCost
from ..drafters.base import DraftContext, Drafter, Proposal
from ..logits.grammar import mask_logits
from ..logits.sampling import logits_to_probs, sample
from ..logits.verify import verify
from ..runtime.model.forward import StepOutput
from ..runtime.steps.warmup import decode_path
from ..stats import acceptance_rate, generation_stats, tau
from ..types import CancelToken, DeltaCallback, EngineConfig, GenerationResult
from .run import Run, end_of_output


class Rounds:
    """The steps of a goal's rounds, shared by the single-goal and the batched path (thread-safe measurements)."""

    def __init__(self, config: EngineConfig, device: torch.device, context_limit: int, eos_ids: set[int],
                 response_open: int | None, plain: Drafter):
        """
        response_open: the token that ends a reply asking for tool results (finish reason tool_calls).

        plain: the 'none' drafter, which takes over a goal whose drafter raised.
        """
        self.config, self.device, self.context_limit = config, device, context_limit
        self.eos_ids = eos_ids
        self._response_open = response_open
        self._plain = plain
        self.measure_lock = threading.Lock()  # the controllers, the cost curve and the lifetime counters
        self.target_cost = TargetCost(config.max_draft_tokens + 1)  # single-goal verify passes by size
        self.step_runners: list = []          # the compiled step tables, for a result's decode path
        self._lifetime = {'goals': 0, 'tokens': 0, 'passes': 0, 'drafted': 0, 'accepted': 0}

    def new_controller(self, drafter: Drafter, target_cost: TargetCost) -> SpeculationController:
        """Make a controller of the config's K, gate and probe interval, pricing verify passes by target_cost."""
        return SpeculationController(self.config.max_draft_tokens, target_cost, self.config.profit_gate,
                                     self.config.probe_interval, drafter.cut_saves_drafting)

    # --------------------------------------------------------------------------------------------- the round
    def start(self, run: Run) -> None:
        """Start the goal's drafters on its prompt and their controllers on a new text (before its prefill)."""
        for drafter in run.drafters():
            self.call_drafter(run, lambda drafter=drafter: drafter.start(run.tokens), drafter)
        with self.measure_lock:
            for drafter, controller in run.speculators():
                # a new text: a gate paused on the previous one probes at once (unless the request pins K; an auto
                # goal's members probe at their gates' pace, the others drafting meanwhile)
                controller.start(drafter.draft_calls(run.plan.sampling, run.constraint is not None),
                                 pinned_k=bool(run.plan.pinned_k), probe_now=run.auto is None)

    def first_token(self, run: Run, out: StepOutput) -> list[int]:
        """Pick the first token from the prefill pass (its last position in out) and let the drafter see the pass."""
        logits = out.logits[0, -1:]  # [1, vocab]
        if run.constraint is not None:
            logits = mask_logits(logits, run.constraint.next_mask(self.device))
        sampling = run.plan.sampling
        run.last_token = logits.argmax(dim=-1) if sampling.greedy else sample(logits_to_probs(logits, sampling),
                                                                              run.generator)
        for drafter in run.drafters():  # out holds the last prompt position
            self.call_drafter(run, lambda drafter=drafter: drafter.observe(out, 1, 1), drafter)
        run.tally.add_prefill(time.perf_counter())
        return [run.last_token.item()]

    def plan(self, run: Run, max_k: int) -> tuple[Decision, int]:
        """
        Decide the round's K: pinned, or the controller's (else 0), within the goal's budget and max_k.

        The budget leaves room for the round's own next token within max_new_tokens and the context.
        """
        budget = min(run.plan.max_new_tokens - len(run.generated), self.context_limit - len(run.tokens)) - 1
        if run.auto is not None:  # the round's member drafts it, as its controller decides (decoding/auto.py)
            with self.measure_lock:
                drafter, run.controller, decision = run.auto.choose(run.tokens, run.plan.pinned_k,
                                                                    run.plan.sampling.greedy)
            run.drafter = drafter or self._plain
        elif run.controller is None:
            return Decision(0, False), 0
        elif run.plan.pinned_k:
            decision = Decision(run.plan.pinned_k, True)
        else:
            with self.measure_lock:
                decision = run.controller.decide()
        run.tally.paused_rounds += not decision.speculating and decision.num_draft_tokens == 0
        return decision, max(0, min(decision.num_draft_tokens, budget, max_k))

    def draft_context(self, run: Run, decision: Decision) -> DraftContext:
        return DraftContext(run.tokens, run.last_token, run.plan.sampling, run.generator, decision.min_confidence,
                            run.constraint)

    def propose(self, run: Run, decision: Decision, k: int) -> Proposal | None:
        """Draft the goal's K tokens (None for a plain round, or when its drafter raised)."""
        if k <= 0:
            return None
        context = self.draft_context(run, decision)
        return self.call_drafter(run, lambda: run.drafter.propose(context, k))

    def wants_states(self, run: Run) -> bool:
        """Whether the round's pass must return what a drafter reads next round (MTP: unless surely plain next)."""
        if not run.needs_target_states or run.auto is not None or run.plan.pinned_k:
            return run.needs_target_states
        with self.measure_lock:
            return run.controller is None or run.controller.may_speculate_next()

    @staticmethod
    def takes_pass_verdict(run: Run) -> bool:
        """Whether the goal's verdict is the pass's greedy one (else verify(): sampled, or under a grammar)."""
        return run.plan.sampling.greedy and run.constraint is None

    def verify(self, run: Run, proposal: Proposal | None, logits: torch.Tensor) -> torch.Tensor:
        """
        Verify the goal's drafts against its logits [k + 1, vocab], with its grammar and generator.

        Returns [k + 2]: the accepted count, the drafts, and the next (recovered or bonus) token.
        """
        draft_tokens = run.last_token[:0] if proposal is None else proposal.tokens  # [k]
        if run.constraint is not None:  # while the target runs on a GPU: masks along the drafts, on the host
            masks, _ = run.constraint.masks_along(draft_tokens.tolist(), self.device)  # [k + 1, vocab]
            logits = mask_logits(logits, masks)
        sampling = run.plan.sampling
        target_probs = logits if sampling.greedy else logits_to_probs(logits, sampling)
        draft_probs = None if proposal is None or proposal.draft_probs is None else proposal.draft_probs[None]
        num_accepted, next_token = verify(draft_tokens[None], target_probs[None], draft_probs, sampling.greedy,
                                          run.generator)
        return torch.cat([num_accepted, draft_tokens, next_token])

    @staticmethod
    def num_drafted(proposal: Proposal | None) -> int:
        return 0 if proposal is None else proposal.tokens.shape[0]

    def accept(self, run: Run, proposal: Proposal | None, out: StepOutput, verdict: list[int],
               last_token: torch.Tensor | None = None) -> list[int]:
        """
        Take a verdict on the host (the accepted count, the drafts, ..., the next token) once the cache kept its K/V.

        The drafters see the goal's pass (out: its row only; an auto goal's members all do, whoever drafted) and
        roll back likewise. last_token: the next token already on the device, if at hand. Returns the round's
        tokens: the accepted drafts and the next token.
        """
        num_drafted, accepted, name = self.num_drafted(proposal), verdict[0], run.drafter.name
        for drafter in run.drafters():
            self.call_drafter(run, lambda drafter=drafter: drafter.observe(out, num_drafted + 1, accepted + 1),
                              drafter)
        run.last_token = last_token if last_token is not None else torch.tensor(verdict[-1:], device=self.device)
        run.tally.add_round(num_drafted, accepted, time.perf_counter(), name)
        tokens = verdict[1:1 + accepted] + verdict[-1:]
        if run.auto is not None:
            with self.measure_lock:
                run.auto.after_round(tokens)
        return tokens

    def record(self, run: Run, proposal: Proposal | None, accepted: int, draft_seconds: float,
               round_seconds: float) -> None:
        """Tell the goal's controller how its round went: drafts, accepted ones, drafting time and the round's."""
        confidences = None if proposal is None or proposal.confidences is None else proposal.confidences.tolist()
        with self.measure_lock:
            if run.controller is not None:
                run.controller.record(self.num_drafted(proposal), accepted, draft_seconds, confidences=confidences,
                                      round_seconds=round_seconds)
            if run.auto is not None:  # which drafter the round judged, the state it left the text in
                run.auto.after_record(self.num_drafted(proposal), accepted)

    def emit(self, run: Run, new_tokens: list[int], on_delta: DeltaCallback | None,
             cancel: CancelToken | None) -> bool:
        """
        Append a round's tokens, apply EOS / max_new_tokens / stop strings, stream the new text; end a goal cancelled.

        Returns whether the goal has ended.
        """
        new_tokens, run.finish = end_of_output(new_tokens, self.eos_ids, len(run.generated),
                                               run.plan.max_new_tokens, self._response_open)
        if run.constraint is not None:
            run.constraint.accept(new_tokens)
        run.tokens += new_tokens
        run.generated += new_tokens
        text, thought, calls = run.reply.add([t for t in new_tokens if t not in self.eos_ids])
        text = run.stops.feed(text)
        if run.stops.stopped:
            run.finish = 'stop'
        elif run.finish:
            tail, thought_tail = run.release_held()
            text, thought = text + tail, thought + thought_tail
            run.finish = 'stop' if run.stops.stopped or (run.finish == 'tool_calls' and not run.reply.calls) \
                else run.finish
        run.send(text, new_tokens, on_delta, thought, calls)
        if not run.finish and cancel is not None and cancel.cancelled:
            self.end_cancelled(run, on_delta)
        return bool(run.finish)

    def end_cancelled(self, run: Run, on_delta: DeltaCallback | None) -> None:
        """End a cancelled goal: stream what was held back."""
        tail, thought = run.release_held()
        if tail or thought:
            run.send(tail, [], on_delta, thought)
        run.finish = 'cancelled'

    def result(self, run: Run, started: float, steps_before: tuple[int, int], mode: str) -> GenerationResult:
        """
        Build the goal's result and statistics; a goal that speculated to its end adds to the lifetime counters.

        Plain ones (drafter none, or a fallback) stay out: their tau of 1 would hide what speculation achieves.
        mode: the target's compile mode, for the decode path (steps_before: step_calls when the goal started).
        """
        with self.measure_lock:
            controller = run.controller if run.auto is None else run.auto.main_controller(run.tally.by_drafter)
            cost_ratio = self.cost_ratio(controller) if controller is not None else 0.0
            if run.speculates:
                for key, value in (('goals', 1), ('tokens', len(run.generated)), ('passes', run.tally.target_passes),
                                   ('drafted', run.tally.drafted), ('accepted', run.tally.accepted)):
                    self._lifetime[key] += value
        stats = generation_stats(run.tally, len(run.plan.prompt_ids), len(run.generated), started,
                                 time.perf_counter(), run.plan.drafter if run.speculates else 'none',
                                 cost_ratio)
        stats.decode_path = decode_path(self.step_runners, steps_before, mode)
        if self.device.type == 'cuda':
            stats.cuda_peak_allocated_bytes = torch.cuda.max_memory_allocated(self.device)
            stats.cuda_peak_reserved_bytes = torch.cuda.max_memory_reserved(self.device)
        return run.result(stats)

    # ------------------------------------------------------------------------------------ failures and measures
    def call_drafter(self, run: Run, drafter_call, drafter: Drafter | None = None):
        """
        Run a call of drafter (default: the round's); one that raises must not fail the goal.

        Plain decoding takes over (an auto goal goes on without that member).
        """
        try:
            return drafter_call()
        except Exception as exc:  # noqa: BLE001 (any drafter failure)
            self.fall_back(run, exc, drafter)
            return None

    def fall_back(self, run: Run, exc: Exception, drafter: Drafter | None = None) -> None:
        run.fall_back(self._plain, exc, drafter)

    def cost_ratio(self, controller: SpeculationController) -> float:
        """c: the controller's drafting seconds per token over a plain single-goal pass (call under measure_lock)."""
        plain = self.target_cost.seconds(1)
        per_token = controller.draft_token_seconds
        return per_token / plain if per_token is not None and plain else 0.0

    def lifetime(self) -> tuple[float, float]:
        """τ and the acceptance rate over every goal that speculated to its end."""
        with self.measure_lock:
            counts = dict(self._lifetime)
        return (tau(counts['tokens'], counts['passes'], counts['goals']),
                acceptance_rate(counts['accepted'], counts['drafted']))

"""The engine: prefill -> draft -> verify -> accept / roll back -> stream, one verify round at a time."""

import threading
import time
from pathlib import Path

import torch

from .. import requests
from ..backend import Backend, Capabilities
from ..control import Decision, SpeculationController, TargetCost
from ..drafters.base import DraftContext, Drafter, Proposal
from ..logits.grammar import ConstraintCompiler, mask_logits
from ..logits.reply import ReplyConstraint
from ..logits.sampling import logits_to_probs, sample
from ..logits.verify import verify
from ..requests import RequestPlan, SamplingParams
from ..runtime import causal_lm, models, vision
from ..runtime.warmup import STOP_WAIT_SECONDS, Warmup, decode_path, order_jobs, step_calls
from ..stats import acceptance_rate, generation_stats, tau
from ..types import (
    REGISTRY,
    CancelToken,
    DeltaCallback,
    DisabledDrafter,
    EngineConfig,
    EngineStatus,
    GenerationRequest,
    GenerationResult,
    GenerationWarning,
    WarmupState,
    WarningKind,
)
from . import calibration, images
from .batch import start_batching
from .run import Run, end_of_output, new_run


class Engine(Backend):
    """The local backend: a loaded target plus drafters serving many generate calls, one at a time (thread-safe)."""

    def __init__(self, config: EngineConfig, target_lm, tokenizer, drafters: dict[str, Drafter], device, dtype,
                 drafter_errors: dict[str, DisabledDrafter] | None = None, warmup: WarmupState | None = None):
        """
        target_lm: the target with its KV cache (causal_lm.build_causal_lm), its drafters already loaded.

        warmup: how the decode steps were warmed up before (blocking, off); from_config starts a background one.
        """
        self.config = config
        self._target = target_lm
        self._tokenizer = tokenizer
        self._drafters = drafters
        self.drafter_errors = dict(drafter_errors or {})  # drafter -> why its model failed to load (disabled)
        self._device, self._dtype = device, dtype
        self._lock = threading.Lock()          # one single-goal generation, or one batched round, at a time
        self._measure_lock = threading.Lock()  # controllers and lifetime counters, read by status()
        self._default_drafter = config.drafter
        self._default_k = config.num_draft_tokens
        self._context_limit = models.context_limit(config, target_lm.model)
        self._vocab_size = models.text_config(target_lm.model).vocab_size
        self._eos_ids = models.eos_token_ids(target_lm.model, tokenizer)
        self._vision = vision.VisionTower.of(target_lm.model, config.target_path)  # None: the target reads text only
        self._warmup_state = warmup or WarmupState(config.warmup)
        self._warmup: Warmup | None = None  # a background warm-up, while and after it runs
        self._batch = start_batching(self, target_lm, drafters)  # None with engine.max_batch 1 (or off the fast path)
        self._graph_jobs, self._default_path_jobs = order_jobs(
            target_lm.graph_jobs('target'), {name: drafter.graph_jobs() for name, drafter in drafters.items()},
            config.drafter)
        if self._batch is not None:  # after the single-goal graphs
            self._graph_jobs += self._batch.graph_jobs
        self._step_runners = list({id(job.steps): job.steps for job in self._graph_jobs}.values())
        self._weights_bytes = causal_lm.weights_bytes(target_lm) + sum(
            drafter.weights_bytes for drafter in drafters.values())
        self._kv_cache_bytes = target_lm.nbytes + sum(drafter.kv_cache_bytes for drafter in drafters.values()) + (
            0 if self._batch is None else self._batch.rows.nbytes)
        self._constraints = ConstraintCompiler(tokenizer, self._vocab_size, self._eos_ids)  # EOS ends a grammar
        self._target_cost = TargetCost(config.max_draft_tokens + 1)
        self._controllers = {name: SpeculationController(config.max_draft_tokens, self._target_cost,
                                                         config.profit_gate, config.probe_interval,
                                                         drafter.cut_saves_drafting)
                             for name, drafter in drafters.items() if name != 'none'}
        self._lifetime = {'tokens': 0, 'passes': 0, 'drafted': 0, 'accepted': 0}
        self.set_default_drafter(config.drafter)

    @classmethod
    def from_config(cls, config: EngineConfig, progress=None, tolerate_drafter_errors: bool = False,
                    start_warmup: bool = True) -> 'Engine':
        """Load the target and the drafters config names, and warm up (loading.load_engine); ValueError if unfit."""
        from .loading import load_engine

        return load_engine(config, progress, tolerate_drafter_errors, start_warmup)

    @property
    def graph_jobs(self) -> tuple:
        """Every compiled step graph of this engine's models, as runtime.GraphJob (none without CPU inductor)."""
        return tuple(self._graph_jobs)

    @property
    def warmup(self) -> Warmup | None:
        """The background warm-up (None with another policy, or nothing to compile): wait(), stop(), state()."""
        return self._warmup

    def close(self) -> None:
        """
        Stop a background warm-up and wait for the graph it is building (the engine serves on what is built).

        Waiting lets go of the models the warm-up thread holds, so that dropping the engine frees them. With
        batching, the scheduler stops once its running goals have ended.
        """
        if self._warmup is not None:
            self._warmup.stop(timeout=STOP_WAIT_SECONDS)
        if self._batch is not None:
            self._batch.close(timeout=STOP_WAIT_SECONDS)

    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def eos_token_ids(self) -> list[int]:
        return sorted(self._eos_ids)

    def set_default_drafter(self, name: str) -> None:
        """Drafter used by requests that leave drafter empty."""
        requests.check_drafter(name, self._usable_drafters())
        self._default_drafter = name

    def set_default_num_draft_tokens(self, k: int) -> None:
        """K used by requests that leave num_draft_tokens 0; 0 = adaptive."""
        requests.check_num_draft_tokens(k, self.config)
        self._default_k = k

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities('local', tuple(sorted(self._usable_drafters())), num_draft_tokens_per_goal=True,
                            max_concurrent_goals=1 if self._batch is None else self._batch.num_slots,
                            image_refusal='' if self._vision is not None else requests.TEXT_ONLY_TARGET)

    @property
    def device(self) -> str:
        return str(self._device)

    def describe(self) -> str:
        return 'target {} on {}, drafters {}'.format(Path(self.config.target_path).name, self._device,
                                                     ', '.join(sorted(self._drafters)))

    @property
    def warnings(self) -> list[GenerationWarning]:
        warnings = [GenerationWarning(WarningKind.DRAFTER_FALLBACK, '{}; goals asking for it run plain decoding'.format(
            disabled.describe())) for disabled in self.drafter_errors.values()]
        if self.config.max_batch != 1 and self._batch is None:  # transformers' forward has no batched steps
            warnings.append(GenerationWarning(WarningKind.CONFIGURATION, "engine.max_batch needs the fast path, not "
                                              "transformers' forward: goals run one at a time"))
        return warnings

    def _usable_drafters(self):
        return set(self._drafters) | set(self.drafter_errors)  # a broken drafter runs plain, with a warning

    def status(self) -> EngineStatus:
        """Return a snapshot for diagnostics (safe from any thread)."""
        name = self._default_drafter
        path = getattr(self.config, REGISTRY[name].path_field) if REGISTRY[name].path_field else ''
        warmup = self._warmup_state if self._warmup is None else self._warmup.state()
        with self._measure_lock:
            lifetime = dict(self._lifetime)
            status = EngineStatus(
                target_id=Path(self.config.target_path).name, drafter=name, drafter_id=Path(path).name if path else '',
                device=str(self._device), dtype=str(self._dtype).replace('torch.', ''),
                compile_mode=self._target.mode, warmup=warmup,
                weights_bytes=self._weights_bytes, kv_cache_bytes=self._kv_cache_bytes,
                **({} if self._batch is None else self._batch.status_fields()),
                tau_lifetime=tau(lifetime['tokens'], lifetime['passes']),
                acceptance_rate_lifetime=acceptance_rate(lifetime['accepted'], lifetime['drafted']),
                disabled_drafters=list(self.drafter_errors.values()))
            controller = self._controllers.get(name)
            if controller is not None:
                k = self._default_k or controller.best_k()
                status.num_draft_tokens = k
                status.draft_cost_ratio = self._cost_ratio(controller)
                status.break_even_tau = controller.break_even_tau(k)
                status.speculating = self._default_k > 0 or controller.speculating
        return status

    def _cost_ratio(self, controller: SpeculationController) -> float:
        plain = self._target_cost.seconds(1)
        per_token = controller.draft_token_seconds
        return per_token / plain if per_token is not None and plain else 0.0

    def validate(self, request: GenerationRequest) -> RequestPlan:
        """Check a request and tokenize its prompt (no model work): the plan, or ValueError naming the field."""
        return requests.plan_request(request, self._tokenizer, self._vocab_size, self._context_limit, self.config,
                                     self._usable_drafters(), self._default_drafter, self._default_k,
                                     self._constraints, self._vision)

    def generate(self, request: GenerationRequest | RequestPlan, on_delta: DeltaCallback | None = None,
                 cancel: CancelToken | None = None) -> GenerationResult:
        """Run one request (or a plan from validate); one StreamDelta per verify round. One request at a time."""
        plan = request if isinstance(request, RequestPlan) else self.validate(request)
        run = self._new_run(plan)
        if self._batch is not None and self._batch.takes(run.drafter) and not plan.images:  # images: one at a time
            return self._batch.generate(run, on_delta, cancel, step_calls(self._step_runners))
        with self._lock, torch.inference_mode():
            return self._run(run, on_delta, cancel)

    # verify-cost calibration (calibration.py): functions of an engine, offered as its methods
    time_target_passes = calibration.time_target_passes
    median_target_passes = calibration.median_target_passes
    calibrate_verify_costs = calibration.calibrate_verify_costs

    # ----------------------------------------------------------------------------------------------- the loop
    def _new_run(self, plan: RequestPlan) -> Run:
        """Make the state of a generation, with its drafter (plain, with a warning, if that one failed to load)."""
        run = new_run(plan, self._drafters['none'], self._tokenizer, self._device, self._constraints.conversation)
        if plan.compiled_grammar is not None:
            run.constraint = self._constraints.matcher(plan.compiled_grammar)
        # declared tools: calls only as tool_choice allows; a chat turn without tools (or a grammar) never calls one
        if plan.reply.thinking or plan.tools or (plan.reply.chat and run.constraint is None):
            run.constraint = ReplyConstraint(self._constraints, plan.reply, run.constraint, plan.compiled_calls)
        if plan.drafter in self.drafter_errors:
            run.warnings.append(GenerationWarning(WarningKind.DRAFTER_FALLBACK, '{}; ran plain decoding'.format(
                self.drafter_errors[plan.drafter].describe())))
        else:
            run.drafter, run.controller = self._drafters[plan.drafter], self._controllers.get(plan.drafter)
        return run

    def _run(self, run: Run, on_delta: DeltaCallback | None, cancel: CancelToken | None) -> GenerationResult:
        started = time.perf_counter()
        steps_before = step_calls(self._step_runners)
        if self._device.type == 'cuda':
            torch.cuda.reset_peak_memory_stats(self._device)
        self._target.reset()
        if cancel is not None and cancel.cancelled:  # cancelled while it waited for the engine: nothing runs
            run.finish = 'cancelled'
            return self._result(run, started, steps_before)
        new_tokens = self._prefill(run)
        while True:
            self._emit(run, new_tokens, on_delta)
            if run.finish:
                break
            if cancel is not None and cancel.cancelled:
                self._end_cancelled(run, on_delta)
                break
            new_tokens = self._speculate(run)
        return self._result(run, started, steps_before)

    def _prefill(self, run: Run) -> list[int]:
        """Start the drafter, run the prompt through the target in one pass and pick the first token."""
        self._call_drafter(run, lambda: run.drafter.start(run.tokens))
        if run.controller is not None:
            with self._measure_lock:
                # a new text: a gate paused on the previous one probes at once (unless the request pins K)
                run.controller.start(run.drafter.draft_calls(run.plan.sampling, run.constraint is not None),
                                     pinned_k=bool(run.plan.pinned_k))
        prompt = torch.tensor([run.tokens], device=self._device)
        out = self._target.prefill(prompt, 1, run.drafter.needs_target_states, images.soft_tokens(self._vision, run))
        logits = out.logits[0, -1:]  # [1, vocab]
        if run.constraint is not None:
            logits = mask_logits(logits, run.constraint.next_mask(self._device))
        first = self._first_token(logits, run.plan.sampling, run.generator)
        self._call_drafter(run, lambda: run.drafter.observe(out, 1, 1))  # out holds the last prompt position
        run.last_token = first
        token = first.item()
        run.tally.add_prefill(time.perf_counter())
        return [token]

    def _speculate(self, run: Run) -> list[int]:
        """One round: draft K tokens, verify them in one target pass, roll back the rejected ones, measure."""
        if self._warmup is not None:
            self._warmup.adopt()  # graphs built since the last round take over: the whole round runs on them
        round_start = run.stopwatch.mark()
        budget = min(run.plan.max_new_tokens - len(run.generated), self._context_limit - len(run.tokens)) - 1
        decision = self._decide(run.plan, run.controller)
        decided_at = run.stopwatch.mark()  # the controller's own work counts as loop overhead, not drafting
        k = min(decision.num_draft_tokens, budget)
        run.tally.paused_rounds += not decision.speculating and decision.num_draft_tokens == 0
        proposal = None
        if k > 0:
            context = DraftContext(run.tokens, run.last_token, run.plan.sampling, run.generator,
                                   decision.min_confidence, run.constraint)
            proposal = self._call_drafter(run, lambda: run.drafter.propose(context, k))
        num_drafted = 0 if proposal is None else proposal.tokens.shape[0]
        drafted_at = run.stopwatch.mark()

        # verify: one target pass over [last token, d1..dK]; the MTP drafter reads this pass's hidden state and
        # K/V, unless the next round is surely plain
        draft_tokens = run.last_token[:0] if proposal is None else proposal.tokens  # [k]
        with self._measure_lock:
            may_draft_next = run.controller is None or run.controller.may_speculate_next()
        want_states = run.drafter.needs_target_states and (run.plan.pinned_k > 0 or may_draft_next)
        pass_tokens = run.last_token if proposal is None else torch.cat([run.last_token, draft_tokens])
        out = self._target.append(pass_tokens.unsqueeze(0), logits_to_keep=0, want_states=want_states)
        sampling = run.plan.sampling
        if sampling.greedy and run.constraint is None and out.greedy_row is not None:
            row = out.greedy_row  # [k + 2] verify() ran inside the target's pass
        else:
            row = self._verify(run, proposal, draft_tokens, out.logits[0])
        next_token = row[-1:]
        verified_at = run.stopwatch.mark()
        row = row.tolist()  # the round's one host sync
        accepted = row[0]
        confidences = None if proposal is None or proposal.confidences is None else proposal.confidences.tolist()

        # accept / roll back: crop the rejected K/V from the target, and let the drafter do the same
        self._target.crop(-(num_drafted - accepted))
        self._call_drafter(run, lambda: run.drafter.observe(out, num_drafted + 1, accepted + 1))
        with self._measure_lock:
            self._target_cost.record(num_drafted + 1, run.stopwatch.seconds(drafted_at, verified_at))
            if run.controller is not None:
                run.controller.record(num_drafted, accepted, run.stopwatch.seconds(decided_at, drafted_at),
                                      confidences=confidences,
                                      round_seconds=run.stopwatch.seconds(round_start, verified_at))
        run.tally.add_round(num_drafted, accepted, time.perf_counter())
        run.last_token = next_token
        return row[1:1 + accepted] + row[-1:]  # accepted drafts + recovered or bonus token

    def _verify(self, run: Run, proposal: Proposal | None, draft_tokens: torch.Tensor,
                logits: torch.Tensor) -> torch.Tensor:
        """verify() the drafts [k] against the target's logits [k + 1, vocab]: [k + 2] accepted count, drafts, next."""
        if run.constraint is not None:  # while the target runs on a GPU: masks along the drafts, on the host
            masks, _ = run.constraint.masks_along(draft_tokens.tolist(), self._device)  # [k + 1, vocab]
            logits = mask_logits(logits, masks)
        sampling = run.plan.sampling
        target_probs = logits if sampling.greedy else logits_to_probs(logits, sampling)
        draft_probs = None if proposal is None or proposal.draft_probs is None else proposal.draft_probs[None]
        num_accepted, next_token = verify(draft_tokens[None], target_probs[None], draft_probs, sampling.greedy,
                                          run.generator)
        return torch.cat([num_accepted, draft_tokens, next_token])

    def _call_drafter(self, run: Run, drafter_call):
        """Run a drafter call; a drafter that raises must not fail the request: plain decoding takes over."""
        try:
            return drafter_call()
        except Exception as exc:  # noqa: BLE001 (any drafter failure)
            run.fall_back(self._drafters['none'], exc)
            return None

    def _emit(self, run: Run, new_tokens: list[int], on_delta: DeltaCallback | None) -> None:
        """Append a round's tokens, apply EOS / max_new_tokens / stop strings, and stream the new text."""
        new_tokens, run.finish = end_of_output(new_tokens, self._eos_ids, len(run.generated),
                                               run.plan.max_new_tokens, self._constraints.conversation.response_open)
        if run.constraint is not None:
            run.constraint.accept(new_tokens)
        run.tokens += new_tokens
        run.generated += new_tokens
        text, thought, calls = run.reply.add([t for t in new_tokens if t not in self._eos_ids])
        text = run.stops.feed(text)
        if run.stops.stopped:
            run.finish = 'stop'
        elif run.finish:
            tail, thought_tail = run.release_held()
            text, thought = text + tail, thought + thought_tail
            run.finish = 'stop' if run.stops.stopped or (run.finish == 'tool_calls' and not run.reply.calls) \
                else run.finish
        run.send(text, new_tokens, on_delta, thought, calls)

    def _end_cancelled(self, run: Run, on_delta: DeltaCallback | None) -> None:
        """End a cancelled generation: stream what was held back."""
        tail, thought = run.release_held()
        if tail or thought:
            run.send(tail, [], on_delta, thought)
        run.finish = 'cancelled'

    def _first_token(self, logits: torch.Tensor, sampling: SamplingParams, generator) -> torch.Tensor:
        """Pick the first token from prefill logits [1, vocab] -> [1]."""
        if sampling.greedy:
            return logits.argmax(dim=-1)
        return sample(logits_to_probs(logits, sampling), generator)

    def _decide(self, plan: RequestPlan, controller: SpeculationController | None) -> Decision:
        """K (and the drafter's confidence cut-off) for the next round; a pinned K is drafted in full."""
        if controller is None:
            return Decision(0, False)
        if plan.pinned_k:
            return Decision(plan.pinned_k, True)
        with self._measure_lock:
            return controller.decide()

    def _result(self, run: Run, started: float, steps_before: tuple[int, int]) -> GenerationResult:
        """
        Build the result with its statistics; a generation that speculated to its end adds to the lifetime counters.

        Plain ones (drafter none, or a fallback) stay out: their tau of 1 would hide what speculation achieves.
        """
        with self._measure_lock:
            cost_ratio = self._cost_ratio(run.controller) if run.controller is not None else 0.0
            if run.controller is not None:
                for key, value in (('tokens', len(run.generated)), ('passes', run.tally.target_passes),
                                   ('drafted', run.tally.drafted), ('accepted', run.tally.accepted)):
                    self._lifetime[key] += value
        stats = generation_stats(run.tally, len(run.plan.prompt_ids), len(run.generated), started,
                                 time.perf_counter(), run.plan.drafter if run.controller is not None else 'none',
                                 cost_ratio)
        stats.decode_path = decode_path(self._step_runners, steps_before, self._target.mode)
        if self._device.type == 'cuda':
            stats.cuda_peak_allocated_bytes = torch.cuda.max_memory_allocated(self._device)
            stats.cuda_peak_reserved_bytes = torch.cuda.max_memory_reserved(self._device)
        return run.result(stats)


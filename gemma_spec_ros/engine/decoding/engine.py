"""The local engine: a loaded target and its drafters serving goals; the single-goal loop runs the target's passes."""

import contextlib
import threading
import time
from pathlib import Path

import torch

from .. import config_checks, requests
from ..backend import Backend, Capabilities
from ..control import SpeculationController, TargetCost
from ..drafters.base import Drafter
from ..logits.grammar import ConstraintCompiler
from ..logits.reply import ReplyConstraint
from ..requests import RequestPlan
from ..runtime.model import checkpoints, vision
from ..runtime.model.prefix_cache import PrefixCache
from ..runtime.steps import causal_lm
from ..runtime.steps.warmup import STOP_WAIT_SECONDS, Warmup, order_jobs, step_calls, warm_up_blocking
from ..types import (
    AUTO,
    REGISTRY,
    CancelToken,
    DeltaCallback,
    DisabledDrafter,
    EngineConfig,
    EngineStatus,
    GenerationRequest,
    GenerationResult,
    GenerationWarning,
    PrefixCacheStatus,
    WarmupState,
    WarningKind,
)
from . import auto, calibration, images
from .batch import BatchScheduler, start_batching
from .loading import load_parts, ready_message
from .rounds import Rounds
from .run import Run, new_run

COMPILE_WORKER = __package__ + '.compile_worker'  # a background warm-up's process (it loads an Engine: no import)


class Engine(Backend):
    """The local backend: a loaded target plus drafters serving many generate calls, one at a time (thread-safe)."""

    def __init__(self, config: EngineConfig, target_lm, tokenizer, drafters: dict[str, Drafter], device, dtype,
                 drafter_errors: dict[str, DisabledDrafter] | None = None, warmup: WarmupState | None = None,
                 prefix_caches: list[PrefixCache] = ()):
        """
        target_lm: the target with its KV cache (causal_lm.build_causal_lm), its drafters already loaded.

        warmup: how the decode steps were warmed up before (blocking, off); from_config starts a background one.

        prefix_caches: the target's (first) and its drafters' (loading.prefix_caches); none: every prompt prefilled.
        """
        self.config = config
        self._target = target_lm
        self._tokenizer = tokenizer
        self._drafters = drafters
        self.drafter_errors = dict(drafter_errors or {})  # drafter -> why its model failed to load (disabled)
        self._device, self._dtype = device, dtype
        self._lock = threading.Lock()          # one single-goal generation, or one batched round, at a time
        self._default_drafter = config.drafter
        self._default_k = config.num_draft_tokens
        self._context_limit = checkpoints.context_limit(config, target_lm.model)
        self._vocab_size = checkpoints.text_config(target_lm.model).vocab_size
        self._eos_ids = checkpoints.eos_token_ids(target_lm.model, tokenizer)
        self._vision = vision.VisionTower.of(target_lm.model, config.target_path)  # None: the target reads text only
        self._warmup_state = warmup or WarmupState(config.warmup)
        self._warmup: Warmup | None = None  # a background warm-up, while and after it runs
        self._constraints = ConstraintCompiler(tokenizer, self._vocab_size, self._eos_ids)  # EOS ends a grammar
        self._rounds = Rounds(config, device, self._context_limit, self._eos_ids,
                              self._constraints.conversation.response_open, drafters['none'])
        # None with engine.max_batch 1 (or off the fast path)
        self._prefix_caches = list(prefix_caches)
        self._prefix = self._prefix_caches[0] if prefix_caches else None  # the target's
        self._batch = start_batching(self._rounds, target_lm, drafters, self._lock, self.adopt_built_graphs,
                                     self._prefix)
        self._graph_jobs, self._default_path_jobs = order_jobs(
            target_lm.graph_jobs('target'), {name: drafter.graph_jobs() for name, drafter in drafters.items()},
            config.drafter)
        if self._batch is not None:  # after the single-goal graphs
            self._graph_jobs += self._batch.graph_jobs
        self._step_runners = list({id(job.steps): job.steps for job in self._graph_jobs}.values())
        self._rounds.step_runners = self._step_runners
        self._weights_bytes = causal_lm.weights_bytes(target_lm) + sum(
            drafter.weights_bytes for drafter in drafters.values())
        self._kv_cache_bytes = target_lm.nbytes + sum(drafter.kv_cache_bytes for drafter in drafters.values()) + (
            0 if self._batch is None else self._batch.rows.nbytes)
        self._controllers = {name: self._rounds.new_controller(drafter, self._rounds.target_cost)
                             for name, drafter in drafters.items() if name != 'none'}
        self.set_default_drafter(config.drafter)

    @classmethod
    def from_config(cls, config: EngineConfig, progress=None, tolerate_drafter_errors: bool = False,
                    start_warmup: bool = True) -> 'Engine':
        """
        Load the models config names (loading.load_parts), build the engine and warm it up; ValueError if unfit.

        start_warmup: False leaves a background warm-up to warmup.start() or its build calls (benchmarks, tests).
        """
        progress = progress or (lambda message: None)
        engine = cls(**vars(load_parts(config, progress, tolerate_drafter_errors)))
        engine.warm_up(progress, COMPILE_WORKER)
        progress(ready_message(engine))
        if engine.warmup is not None and start_warmup:
            engine.warmup.start()
        return engine

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
    def context_limit(self) -> int:
        """Tokens a goal's prompt and reply may hold together."""
        return self._context_limit

    # ------------------------------------------------------------------ its parts, for measurements and tests
    @property
    def target_lm(self):
        """The target with its KV cache (runtime.causal_lm); step it only inside exclusive()."""
        return self._target

    @property
    def vision(self) -> vision.VisionTower | None:
        """The target's vision tower (None: it reads text only)."""
        return self._vision

    @property
    def batch(self) -> BatchScheduler | None:
        """The continuous-batching scheduler (None with engine.max_batch 1, or off the fast path)."""
        return self._batch

    @property
    def constraints(self) -> ConstraintCompiler:
        return self._constraints

    @property
    def verify_costs(self) -> TargetCost:
        """The single-goal verify passes' cost curve, by tokens per pass."""
        return self._rounds.target_cost

    def drafter(self, name: str) -> Drafter:
        """Return the loaded drafter of that name (KeyError if it is not loaded)."""
        return self._drafters[name]

    def controller(self, name: str) -> SpeculationController | None:
        """Return the single-goal controller of that drafter (None for none, or a drafter not loaded)."""
        return self._controllers.get(name)

    @contextlib.contextmanager
    def exclusive(self):
        """Hold the engine between goals, in inference mode: no goal or batched round runs meanwhile."""
        with self._lock, torch.inference_mode():
            yield self._target

    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def eos_token_ids(self) -> list[int]:
        return sorted(self._eos_ids)

    def set_default_drafter(self, name: str) -> None:
        """Drafter used by requests that leave drafter empty."""
        config_checks.check_drafter(name, self._usable_drafters())
        self._default_drafter = name

    def set_default_num_draft_tokens(self, k: int) -> None:
        """K used by requests that leave num_draft_tokens 0; 0 = adaptive."""
        config_checks.check_num_draft_tokens(k, self.config)
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

    def _usable_drafters(self):  # a broken drafter runs plain, with a warning; auto chooses among the loaded ones
        return set(self._drafters) | set(self.drafter_errors) | {AUTO}

    def status(self) -> EngineStatus:
        """Return a snapshot for diagnostics (safe from any thread)."""
        name = self._default_drafter
        spec = REGISTRY.get(name, REGISTRY['none'])  # auto: no model of its own
        path = getattr(self.config, spec.path_field) if spec.path_field else ''
        warmup = self._warmup_state if self._warmup is None else self._warmup.state()
        tau_lifetime, acceptance_lifetime = self._rounds.lifetime()
        status = EngineStatus(
            target_id=Path(self.config.target_path).name, drafter=name, drafter_id=Path(path).name if path else '',
            device=str(self._device), dtype=str(self._dtype).replace('torch.', ''),
            compile_mode=self._target.mode, warmup=warmup,
            weights_bytes=self._weights_bytes, kv_cache_bytes=self._kv_cache_bytes,
            **({} if self._batch is None else self._batch.status_fields()),
            tau_lifetime=tau_lifetime, acceptance_rate_lifetime=acceptance_lifetime,
            disabled_drafters=list(self.drafter_errors.values()), prefix_cache=self._prefix_status())
        with self._rounds.measure_lock:
            controller = self._controllers.get(name) if name != AUTO else auto.preferred(self._controllers)
            if controller is not None:
                k = self._default_k or controller.best_k()
                status.num_draft_tokens = k
                status.draft_cost_ratio = self._rounds.cost_ratio(controller)
                status.break_even_tau = controller.break_even_tau(k)
                status.speculating = self._default_k > 0 or controller.speculating
        return status

    def clear_prefix_cache(self) -> None:
        """Forget every cached prompt prefix (the target's and the drafters'), freeing their memory."""
        with self._lock:
            for cache in self._prefix_caches:
                cache.clear()

    def _prefix_status(self) -> PrefixCacheStatus | None:
        if self._prefix is None:
            return None
        # counters read without the engine's lock, which a goal holds for all of its decoding (status() must not wait)
        target = self._prefix.stats()
        held = sum(cache.stats().nbytes for cache in self._prefix_caches)
        return PrefixCacheStatus(target.lookups, target.hits, target.tokens_reused, held,
                                 int(self.config.prefix_cache_mb * 2 ** 20), target.evictions)

    def validate(self, request: GenerationRequest) -> RequestPlan:
        """Check a request and tokenize its prompt (no model work): the plan, or ValueError naming the field."""
        return requests.plan_request(request, requests.PlanContext(
            self._tokenizer, self._vocab_size, self._context_limit, self.config, tuple(self._usable_drafters()),
            self._default_drafter, self._default_k, self._constraints, self._vision))

    def generate(self, request: GenerationRequest | RequestPlan, on_delta: DeltaCallback | None = None,
                 cancel: CancelToken | None = None) -> GenerationResult:
        """Run one request (or a plan from validate); one StreamDelta per verify round. One request at a time."""
        plan = request if isinstance(request, RequestPlan) else self.validate(request)
        run = self._new_run(plan)
        if self._batch is not None and self._batch.takes(run) and not plan.images:  # images: one at a time
            return self._batch.generate(run, on_delta, cancel, step_calls(self._step_runners))
        with self._lock, torch.inference_mode():
            return self._run(run, on_delta, cancel)

    def adopt_built_graphs(self) -> None:
        """Let graphs a background warm-up built take over (between rounds: a whole round runs on them)."""
        if self._warmup is not None:
            self._warmup.adopt()

    # ------------------------------------------------------------------------------- verify-cost calibration
    def time_target_passes(self, prompt_ids: list[int], sizes: list[int]) -> dict[int, float]:
        """Seconds of one verify pass over n tokens after prompt_ids, for each n in sizes, between goals."""
        calibration.check_passes(prompt_ids, sizes, self.config.max_draft_tokens + 1, self._context_limit)
        with self._lock, torch.inference_mode():
            self.adopt_built_graphs()  # time the graphs built so far
            return calibration.time_passes(self._target, self._device, prompt_ids, sizes)

    def median_target_passes(self, prompt_ids: list[int], rounds: int) -> dict[int, float]:
        """Median seconds of verify passes of 1..max_draft_tokens + 1 tokens after prompt_ids."""
        return calibration.median_passes(lambda sizes: self.time_target_passes(prompt_ids, sizes),
                                         self.config.max_draft_tokens + 1, rounds)

    def calibrate_verify_costs(self, rounds: int = calibration.CALIBRATION_ROUNDS) -> dict[int, float]:
        """
        Time verify passes of every size and start the controllers' cost curve there; the median seconds per size.

        Learned only online, the curve's shape comes from adjacent passes of different sizes, which a run pairs
        rarely and with a bias (the first plain pass is timed with the target's weights in cache, verify passes
        after the drafter ran); it priced long drafts too dear.
        """
        medians = self.median_target_passes(calibration.calibration_prompt(
            self._context_limit, self.config.max_draft_tokens, self._vocab_size), rounds)
        with self._rounds.measure_lock:
            self._rounds.target_cost.calibrate(medians)
        return medians

    def calibrate(self, progress) -> None:
        """Calibrate the verify costs when the engine speculates, batched ones too, and report the curves."""
        if self._controllers:
            curve = self.calibrate_verify_costs()
            batched = {} if self._batch is None else self._batch.calibrate(calibration.CALIBRATION_ROUNDS,
                                                                           calibration.CALIBRATION_CONTEXT)
            calibration.report_curve(progress, curve, batched)

    def warm_up(self, progress, compile_module: str) -> None:
        """Warm up as engine.warmup asks (background: a Warmup, not started, compiling in compile_module), calibrate."""
        config = self.config
        background = config.warmup == 'background' and self._graph_jobs
        if config.warmup == 'blocking' or (config.warmup == 'background' and not background):
            self._warmup_state = warm_up_blocking(self._target, self._drafters, progress,
                                                  None if self._batch is None else self._batch.rows)
        if background:
            self._warmup = Warmup(self._graph_jobs, progress, on_compiled=lambda: self.calibrate(progress),
                                  default_path=self._default_path_jobs, compile_process=(config, compile_module))
        if config.warmup != 'off':  # timing every pass size would compile each graph now, not on first use
            self.calibrate(progress)

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
        elif plan.drafter == AUTO:  # every loaded drafter but none, with its controller (decoding/auto.py)
            run.auto = auto.AutoDrafting({n: d for n, d in self._drafters.items() if n != 'none'}, self._controllers)
        else:
            run.drafter, run.controller = self._drafters[plan.drafter], self._controllers.get(plan.drafter)
        return run

    def _run(self, run: Run, on_delta: DeltaCallback | None, cancel: CancelToken | None) -> GenerationResult:
        """Prefill, then rounds until the goal ends (rounds.py holds each step; here: the target's own passes)."""
        started = time.perf_counter()
        steps_before = step_calls(self._step_runners)
        if self._device.type == 'cuda':
            torch.cuda.reset_peak_memory_stats(self._device)
        self._target.reset()
        if cancel is not None and cancel.cancelled:  # cancelled while it waited for the engine: nothing runs
            run.finish = 'cancelled'
        else:
            self._rounds.start(run)
            soft = images.soft_tokens(self._vision, run)
            out, run.tally.cached_prompt_tokens = self._target.prefill_prompt(
                torch.tensor([run.tokens], device=self._device), self._prefix, 1, run.needs_target_states,
                soft, images.image_keys(run, soft))
            new_tokens = self._rounds.first_token(run, out)
            while not self._rounds.emit(run, new_tokens, on_delta, cancel):
                new_tokens = self._round(run)
        return self._rounds.result(run, started, steps_before, self._target.mode)

    def _round(self, run: Run) -> list[int]:
        """One round: draft K tokens, verify them in one target pass, roll back the rejected ones, measure."""
        rounds = self._rounds
        self.adopt_built_graphs()
        round_start = run.stopwatch.mark()
        decision, k = rounds.plan(run, self.config.max_draft_tokens)
        decided_at = run.stopwatch.mark()  # the controller's own work counts as loop overhead, not drafting
        proposal = rounds.propose(run, decision, k)
        drafted_at = run.stopwatch.mark()

        # verify: one target pass over [last token, d1..dK]; the MTP drafter reads this pass's hidden state and
        # K/V, unless the next round is surely plain
        want_states = rounds.wants_states(run)
        pass_tokens = run.last_token if proposal is None else torch.cat([run.last_token, proposal.tokens])
        out = self._target.append(pass_tokens.unsqueeze(0), logits_to_keep=0, want_states=want_states)
        if rounds.takes_pass_verdict(run) and out.greedy_row is not None:
            row = out.greedy_row  # verify() ran inside the target's pass (runtime.StepOutput.greedy_row)
        else:
            row = rounds.verify(run, proposal, out.logits[0])
        verified_at = run.stopwatch.mark()
        verdict = row.tolist()  # the round's one host sync

        # accept / roll back: crop the rejected K/V from the target; the drafter does the same
        num_drafted = rounds.num_drafted(proposal)
        self._target.crop(-(num_drafted - verdict[0]))
        new_tokens = rounds.accept(run, proposal, out, verdict, last_token=row[-1:])
        with rounds.measure_lock:
            rounds.target_cost.record(num_drafted + 1, run.stopwatch.seconds(drafted_at, verified_at))
        rounds.record(run, proposal, verdict[0], run.stopwatch.seconds(decided_at, drafted_at),
                      run.stopwatch.seconds(round_start, verified_at))
        return new_tokens

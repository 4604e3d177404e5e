"""The engine: prefill -> draft -> verify -> accept / roll back -> stream, one verify round at a time."""

import math
import os
import queue
import resource
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import DynamicCache

from . import models
from .adaptive import AdaptiveK, TargetCost
from .drafters import (
    MIN_DRAFT_CONFIDENCE,
    DraftContext,
    Drafter,
    DraftModelDrafter,
    MtpDrafter,
    NgramDrafter,
    NoneDrafter,
    single_token_masks,
)
from .sampling import SamplingParams, logits_to_probs, sample
from .stream import IncrementalDetokenizer, StopStrings
from .types import (
    DRAFTERS,
    CancelToken,
    DeltaCallback,
    EngineConfig,
    EngineStatus,
    GenerationRequest,
    GenerationResult,
    GenerationStats,
    StreamDelta,
)
from .verify import verify

MAX_TEMPERATURE = 2.0


@dataclass
class _Plan:
    """A validated request, ready to run."""

    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    stops: list[str]
    seed: int
    drafter: str
    pinned_k: int        # > 0: fixed K, no adaptation or gating


@dataclass
class _Tally:
    """Counters of one generation, turned into GenerationStats at the end."""

    target_passes: int = 0
    rounds: int = 0                 # decode rounds (after prefill)
    paused_rounds: int = 0          # rounds the profit gate ran plain
    drafted: int = 0
    accepted: int = 0
    drafted_at: list[int] = field(default_factory=list)    # [K] rounds that drafted position i
    accepted_at: list[int] = field(default_factory=list)   # [K] rounds that accepted position i
    token_gaps: list[float] = field(default_factory=list)  # per-token inter-token latency samples (s)

    def add_round(self, num_drafted: int, num_accepted: int, seconds: float) -> None:
        # a round emits num_accepted + 1 tokens after `seconds`: that many latency samples of the per-token share
        emitted = num_accepted + 1
        self.token_gaps.extend([seconds / emitted] * emitted)
        self.rounds += 1
        self.target_passes += 1
        self.drafted += num_drafted
        self.accepted += num_accepted
        while len(self.drafted_at) < num_drafted:
            self.drafted_at.append(0)
            self.accepted_at.append(0)
        for position in range(num_drafted):
            self.drafted_at[position] += 1
            self.accepted_at[position] += position < num_accepted


class _AnyCancel:
    """Cancelled when any of the given tokens is."""

    def __init__(self, *tokens: CancelToken | None):
        self._tokens = [token for token in tokens if token is not None]

    @property
    def cancelled(self) -> bool:
        return any(token.cancelled for token in self._tokens)


class _Stopwatch:
    """Times the parts of a round; on CUDA with events, read after the round's sync (no extra host sync)."""

    def __init__(self, device: torch.device):
        self._cuda = device.type == 'cuda'

    def mark(self):
        if not self._cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start, end) -> float:
        return start.elapsed_time(end) / 1000.0 if self._cuda else end - start


@dataclass
class _Run:
    """The mutable state of one generation."""

    plan: _Plan
    drafter: Drafter
    controller: AdaptiveK | None       # None: plain decoding (drafter 'none' or after a fallback)
    generator: torch.Generator
    cache: DynamicCache
    detokenizer: IncrementalDetokenizer
    stops: StopStrings
    tokens: list[int]                  # prompt + generated; the last one is not in the target cache yet
    last_token: torch.Tensor | None    # [1] tokens[-1] on the device (saves a host-to-device copy per round)
    stopwatch: _Stopwatch
    generated: list[int] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)      # streamed text, one piece per delta
    warnings: list[str] = field(default_factory=list)
    tally: _Tally = field(default_factory=_Tally)
    finish: str = ''
    last_emit: float = 0.0                               # perf_counter() of the last delta

    def fall_back(self, plain: Drafter, exc: Exception) -> None:
        """Continue this request with plain decoding after the drafter raised."""
        self.warnings.append('drafter {!r} failed ({}: {}); fell back to plain decoding'.format(
            self.drafter.name, type(exc).__name__, exc))
        self.drafter, self.controller = plain, None


def peak_rss_bytes() -> int:
    """Process resident-set high-water mark (VmHWM), falling back to getrusage."""
    try:
        with open('/proc/self/status') as status:
            for line in status:
                if line.startswith('VmHWM:'):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _percentile(values: list[float], fraction: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(fraction * (len(ordered) - 1))))]


class Engine:
    """A loaded target plus drafters serving many generate calls, one at a time (thread-safe)."""

    def __init__(self, config: EngineConfig, target, tokenizer, drafters: dict[str, Drafter], device, dtype):
        self.config = config
        self._target = target
        self._tokenizer = tokenizer
        self._drafters = drafters
        self._device = device
        self._dtype = dtype
        self._lock = threading.Lock()
        self._default_drafter = config.drafter
        self._default_k = config.num_draft_tokens
        self._context_limit = models.text_config(target).max_position_embeddings
        self._eos_ids = self._collect_eos_ids()
        self._target_cost = TargetCost(config.max_draft_tokens + 1)
        self._controllers = {name: AdaptiveK(config.max_draft_tokens, self._target_cost, config.profit_gate,
                                             config.probe_interval) for name in drafters if name != 'none'}
        self._lifetime_tokens = 0
        self._lifetime_passes = 0
        self._lifetime_drafted = 0
        self._lifetime_accepted = 0

    # ----------------------------------------------------------------------------------------------- loading
    @classmethod
    def from_config(cls, config: EngineConfig, progress=None) -> 'Engine':
        """Load the target and the configured drafters; raises ValueError when something does not fit."""
        say = progress or (lambda message: None)
        _check_config(config)
        if config.num_threads > 0:
            torch.set_num_threads(config.num_threads)
        device = models.resolve_device(config.device)
        dtype = models.resolve_dtype(config.dtype, device)
        say('loading target {} on {} ({})'.format(config.target_path, device, str(dtype).replace('torch.', '')))
        target = models.load_causal_lm(config.target_path, 'target', device, dtype)
        tokenizer = models.load_tokenizer(config.target_path)
        drafters: dict[str, Drafter] = {'none': NoneDrafter(),
                                        'ngram': NgramDrafter(config.ngram_min, config.ngram_max, device)}
        if config.assistant_path:
            say('loading MTP assistant {}'.format(config.assistant_path))
            assistant = models.load_assistant(config.assistant_path, device, dtype)
            models.check_same_vocab(target, tokenizer, assistant, config.assistant_path, 'MTP assistant')
            models.check_assistant_fits(target, assistant, config.assistant_path)
            drafters['mtp'] = MtpDrafter(assistant, target.get_input_embeddings())
        if config.draft_model_path:
            say('loading draft model {}'.format(config.draft_model_path))
            draft = models.load_causal_lm(config.draft_model_path, 'draft model', device, dtype)
            models.check_same_vocab(target, tokenizer, draft, config.draft_model_path, 'draft model')
            drafters['draft'] = DraftModelDrafter(draft)
        engine = cls(config, target, tokenizer, drafters, device, dtype)
        engine.set_default_drafter(config.drafter)
        say('engine ready: drafters {}'.format(', '.join(sorted(drafters))))
        return engine

    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def eos_token_ids(self) -> list[int]:
        return sorted(self._eos_ids)

    def _collect_eos_ids(self) -> set[int]:
        eos = self._target.generation_config.eos_token_id
        ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self._tokenizer.eos_token_id is not None:
            ids.add(self._tokenizer.eos_token_id)
        end_of_turn = self._tokenizer.get_vocab().get('<end_of_turn>')  # Gemma chat turns end here
        if end_of_turn is not None and '<end_of_turn>' in self._tokenizer.all_special_tokens:
            ids.add(end_of_turn)
        return ids

    # ----------------------------------------------------------------------------------------------- settings
    def set_default_drafter(self, name: str) -> None:
        """Drafter used by requests that leave drafter empty."""
        self._check_drafter(name)
        self._default_drafter = name

    def set_default_num_draft_tokens(self, k: int) -> None:
        """K used by requests that leave num_draft_tokens 0; 0 = adaptive."""
        if not 0 <= k <= self.config.max_draft_tokens:
            raise ValueError('num_draft_tokens must be between 0 (adaptive) and max_draft_tokens={}, got {}'.format(
                self.config.max_draft_tokens, k))
        self._default_k = k

    def _check_drafter(self, name: str) -> None:
        if name not in DRAFTERS:
            raise ValueError('unknown drafter {!r}; choose one of {}'.format(name, ', '.join(DRAFTERS)))
        if name not in self._drafters:
            option = 'assistant_path' if name == 'mtp' else 'draft_model_path'
            raise ValueError('drafter {!r} is not loaded: set engine.{} to its model directory'.format(name, option))

    def status(self) -> EngineStatus:
        """Return a snapshot for diagnostics (safe from any thread)."""
        controller = self._controllers.get(self._default_drafter)
        status = EngineStatus(
            target_id=Path(self.config.target_path).name, drafter=self._default_drafter,
            drafter_id=Path(self._drafter_path(self._default_drafter)).name if self._drafter_path(
                self._default_drafter) else '',
            device=str(self._device), dtype=str(self._dtype).replace('torch.', ''),
            tau_lifetime=self._lifetime_tokens / self._lifetime_passes if self._lifetime_passes else 0.0,
            acceptance_rate_lifetime=(self._lifetime_accepted / self._lifetime_drafted
                                      if self._lifetime_drafted else 0.0))
        if controller is not None:
            k = self._default_k or controller.best_k()
            status.num_draft_tokens = k
            status.draft_cost_ratio = self._cost_ratio(controller)
            status.break_even_tau = controller.break_even_tau(k)
            status.speculating = self._default_k > 0 or controller.speculating
        return status

    def _drafter_path(self, name: str) -> str:
        return {'mtp': self.config.assistant_path, 'draft': self.config.draft_model_path}.get(name, '')

    def _cost_ratio(self, controller: AdaptiveK) -> float:
        plain = self._target_cost.seconds(1)
        step = controller.draft_step_seconds
        return step / plain if step is not None and plain else 0.0

    # ----------------------------------------------------------------------------------------------- requests
    def validate(self, request: GenerationRequest) -> None:
        """Raise ValueError when generate would refuse the request (tokenizes the prompt; no model work)."""
        self._plan(request)

    def _plan(self, request: GenerationRequest) -> _Plan:
        """Validate a request and tokenize its prompt; ValueError with a planner-readable message on bad input."""
        if request.prompt_ids:
            prompt_ids = [int(token) for token in request.prompt_ids]
            vocab = models.text_config(self._target).vocab_size
            if any(not 0 <= token < vocab for token in prompt_ids):
                raise ValueError('prompt_ids must be token ids in [0, {})'.format(vocab))
        elif request.messages:
            prompt_ids = self._encode_messages(request.messages)
        elif request.prompt:
            prompt_ids = self._tokenizer(request.prompt).input_ids
        else:
            raise ValueError('empty request: give a prompt, prompt_ids or chat messages')
        max_new = request.max_new_tokens or self.config.max_new_tokens
        if not 1 <= max_new <= self.config.max_new_tokens_limit:
            raise ValueError('max_new_tokens must be between 1 and {} (engine.max_new_tokens_limit), got {}'.format(
                self.config.max_new_tokens_limit, request.max_new_tokens))
        if len(prompt_ids) + max_new > self._context_limit:
            raise ValueError('prompt ({} tokens) + max_new_tokens ({}) exceeds the model context of {} tokens; '
                             'shorten the prompt or lower max_new_tokens'.format(
                                 len(prompt_ids), max_new, self._context_limit))
        temperature = float(request.temperature)
        if not math.isfinite(temperature) or not 0.0 <= temperature <= MAX_TEMPERATURE:
            raise ValueError('temperature must be a finite number in [0, {:g}] (0 = greedy), got {}'.format(
                MAX_TEMPERATURE, request.temperature))
        top_p = float(request.top_p)
        if top_p != 0.0 and not (math.isfinite(top_p) and 0.0 < top_p <= 1.0):
            raise ValueError('top_p must be in (0, 1] when set (0 = off), got {}'.format(request.top_p))
        if request.top_k < 0:
            raise ValueError('top_k must be >= 0 (0 = off), got {}'.format(request.top_k))
        if any(not stop for stop in request.stop):
            raise ValueError('stop strings must not be empty')
        drafter = request.drafter or self._default_drafter
        self._check_drafter(drafter)
        pinned = request.num_draft_tokens or self._default_k
        if not 0 <= pinned <= self.config.max_draft_tokens:
            raise ValueError('num_draft_tokens must be between 0 (adaptive) and max_draft_tokens={}, got {}'.format(
                self.config.max_draft_tokens, request.num_draft_tokens))
        seed = request.seed if request.seed >= 0 else int.from_bytes(os.urandom(4), 'little')
        if request.seed >= 0 and temperature > 0 and not pinned:
            # adaptive K follows measured timings, which would change the random draws: pin K so that the same
            # seed reproduces the same output
            pinned = max(1, self.config.max_draft_tokens // 2)
        return _Plan(prompt_ids, max_new, SamplingParams(temperature, request.top_k, top_p), list(request.stop),
                     seed, drafter, pinned)

    def _encode_messages(self, messages: list[dict[str, str]]) -> list[int]:
        for message in messages:
            if not isinstance(message, dict) or 'role' not in message or 'content' not in message:
                raise ValueError('each chat message needs "role" and "content", got {!r}'.format(message))
        if not getattr(self._tokenizer, 'chat_template', None):
            raise ValueError('the target tokenizer has no chat template; send a prompt instead of messages')
        text = self._tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self._tokenizer(text, add_special_tokens=False).input_ids

    def generate(self, request: GenerationRequest, on_delta: DeltaCallback | None = None,
                 cancel: CancelToken | None = None) -> GenerationResult:
        """Run one request; on_delta gets one StreamDelta per verify round. Blocks while another request runs."""
        plan = self._plan(request)
        with self._lock, torch.inference_mode():
            return self._run(plan, on_delta, cancel)

    def stream(self, request: GenerationRequest, cancel: CancelToken | None = None) -> Iterator[StreamDelta]:
        """
        Iterate over the deltas of one request; the GenerationResult is the iterator's return value.

        The request is validated here (ValueError at the call). Closing the iterator early cancels the generation.
        """
        return self._stream(self._plan(request), cancel)

    def _stream(self, plan: _Plan, cancel: CancelToken | None) -> Iterator[StreamDelta]:
        deltas: queue.Queue = queue.Queue()
        outcome: dict = {}
        abandoned = CancelToken()

        def work():
            try:
                with self._lock, torch.inference_mode():
                    outcome['result'] = self._run(plan, deltas.put, _AnyCancel(cancel, abandoned))
            except BaseException as exc:  # re-raised in the consumer's thread
                outcome['error'] = exc
            deltas.put(None)

        threading.Thread(target=work, daemon=True).start()
        try:
            while (delta := deltas.get()) is not None:
                yield delta
        finally:
            abandoned.cancel()  # no-op when the run already ended
        if 'error' in outcome:
            raise outcome['error']
        return outcome['result']

    # ----------------------------------------------------------------------------------------------- the loop
    def _forward(self, cache, token_ids: torch.Tensor, start: int, keep_last: int, want_states: bool):
        """One target pass over token_ids [1, q] at positions start..start+q-1."""
        positions = torch.arange(start, start + token_ids.shape[1], device=self._device).unsqueeze(0)
        extra = {'output_hidden_states': -1, 'return_shared_kv_states': True} if want_states else {}
        return self._target(input_ids=token_ids, position_ids=positions, cache=cache, use_cache=True,
                            logits_to_keep=keep_last, attention_mask=single_token_masks(token_ids), **extra)

    def _run(self, plan: _Plan, on_delta: DeltaCallback | None, cancel: CancelToken | None) -> GenerationResult:
        started = time.perf_counter()
        if self._device.type == 'cuda':
            torch.cuda.reset_peak_memory_stats(self._device)
        cache = DynamicCache(config=self._target.config)
        cache.activate_past_recording()  # sliding layers keep rolled-back K/V until the next crop
        run = _Run(plan=plan, drafter=self._drafters[plan.drafter], controller=self._controllers.get(plan.drafter),
                   generator=torch.Generator(device=self._device).manual_seed(plan.seed), cache=cache,
                   detokenizer=IncrementalDetokenizer(self._tokenizer), stops=StopStrings(plan.stops),
                   tokens=list(plan.prompt_ids), last_token=None, stopwatch=_Stopwatch(self._device))
        new_tokens = self._prefill(run)
        first_token_at = run.last_emit = time.perf_counter()
        while True:
            self._emit(run, new_tokens, on_delta)
            if run.finish:
                break
            if cancel is not None and cancel.cancelled:
                tail = self._release_held_text(run)
                if tail:
                    self._send(run, tail, [], on_delta)
                run.finish = 'cancelled'
                break
            new_tokens = self._speculate(run)
        stats = self._stats(run, started, first_token_at, time.perf_counter())
        self._lifetime_tokens += len(run.generated)
        self._lifetime_passes += run.tally.target_passes
        self._lifetime_drafted += run.tally.drafted
        self._lifetime_accepted += run.tally.accepted
        return GenerationResult(''.join(run.pieces), run.generated, run.finish, stats, run.warnings)

    def _prefill(self, run: _Run) -> list[int]:
        """Start the drafter, run the prompt through the target in one pass and pick the first token."""
        try:
            run.drafter.start(run.tokens)
        except Exception as exc:  # a broken drafter must not fail the request
            run.fall_back(self._drafters['none'], exc)
        prompt = torch.tensor([run.tokens], device=self._device)
        out = self._forward(run.cache, prompt, 0, 1, run.drafter.needs_target_states)
        run.cache.crop(0)
        first = self._pick(out.logits[0, -1:], run.plan.sampling, run.generator)
        run.drafter.observe(out, len(run.tokens), len(run.tokens))
        run.tally.target_passes += 1
        run.last_token = first
        return [first.item()]

    def _speculate(self, run: _Run) -> list[int]:
        """One round: draft K tokens, verify them in one target pass, roll back the rejected ones, measure."""
        round_start = run.stopwatch.mark()
        budget = min(run.plan.max_new_tokens - len(run.generated), self._context_limit - len(run.tokens)) - 1
        k, paused = self._choose_k(run.plan, run.controller)
        k = min(k, budget)
        run.tally.paused_rounds += paused
        proposal = None
        if k > 0:
            try:
                context = DraftContext(run.tokens, run.last_token, run.plan.sampling, run.generator,
                                       0.0 if run.plan.pinned_k else MIN_DRAFT_CONFIDENCE)
                proposal = run.drafter.propose(context, k)
            except Exception as exc:  # a broken drafter must not fail the request
                run.fall_back(self._drafters['none'], exc)
        num_drafted = 0 if proposal is None else proposal.tokens.shape[0]
        drafted_at = run.stopwatch.mark()

        draft_tokens = run.last_token[:0] if proposal is None else proposal.tokens  # [k]
        # the MTP drafter reads this pass's hidden state and K/V, unless the next round is surely plain
        want_states = run.drafter.needs_target_states and (
            run.plan.pinned_k > 0 or run.controller is None or run.controller.may_speculate_next())
        out = self._forward(run.cache, torch.cat([run.last_token, draft_tokens]).unsqueeze(0), len(run.tokens) - 1,
                            0, want_states)
        logits = out.logits[0]  # [k + 1, vocab]
        sampling = run.plan.sampling
        target_probs = logits if sampling.greedy else logits_to_probs(logits, sampling)
        draft_probs = None if proposal is None or proposal.draft_probs is None else proposal.draft_probs[None]
        num_accepted, next_token = verify(draft_tokens[None], target_probs[None], draft_probs, sampling.greedy,
                                          run.generator)
        row = torch.cat([num_accepted, draft_tokens, next_token])
        verified_at = run.stopwatch.mark()
        row = row.tolist()  # the round's one host sync
        accepted = row[0]
        run.cache.crop(-(num_drafted - accepted))
        try:
            run.drafter.observe(out, num_drafted + 1, accepted + 1)
        except Exception as exc:
            run.fall_back(self._drafters['none'], exc)

        self._target_cost.record(num_drafted + 1, run.stopwatch.seconds(drafted_at, verified_at))
        if run.controller is not None:
            run.controller.record(num_drafted, accepted, run.stopwatch.seconds(round_start, drafted_at))
        now = time.perf_counter()
        run.tally.add_round(num_drafted, accepted, now - run.last_emit)
        run.last_emit = now
        run.last_token = next_token
        return row[1:1 + accepted] + row[-1:]  # accepted drafts + recovered or bonus token

    def _emit(self, run: _Run, new_tokens: list[int], on_delta: DeltaCallback | None) -> None:
        """Append a round's tokens, apply EOS / max_new_tokens / stop strings, and stream the new text."""
        new_tokens, run.finish = self._cut(new_tokens, len(run.generated), run.plan.max_new_tokens)
        run.tokens += new_tokens
        run.generated += new_tokens
        text = run.stops.feed(run.detokenizer.add([t for t in new_tokens if t not in self._eos_ids]))
        if run.stops.stopped:
            run.finish = 'stop'
        elif run.finish:
            text += self._release_held_text(run)
            run.finish = 'stop' if run.stops.stopped else run.finish
        self._send(run, text, new_tokens, on_delta)

    def _release_held_text(self, run: _Run) -> str:
        """At the end: incomplete characters and possible stop-string prefixes that were held back."""
        text = run.stops.feed(run.detokenizer.flush())
        return text if run.stops.stopped else text + run.stops.flush()

    def _send(self, run: _Run, text: str, token_ids: list[int], on_delta: DeltaCallback | None) -> None:
        run.pieces.append(text)
        if on_delta is not None:
            on_delta(StreamDelta(text, token_ids, len(run.generated), len(run.generated) / run.tally.target_passes))

    def _pick(self, logits: torch.Tensor, sampling: SamplingParams, generator) -> torch.Tensor:
        """Pick the first token from prefill logits [1, vocab] -> [1]."""
        if sampling.greedy:
            return logits.argmax(dim=-1)
        return sample(logits_to_probs(logits, sampling), generator)

    def _choose_k(self, plan: _Plan, controller: AdaptiveK | None) -> tuple[int, bool]:
        """K for the next round and whether the profit gate paused speculation for it."""
        if controller is None:
            return 0, False
        if plan.pinned_k:
            return plan.pinned_k, False
        decision = controller.decide()
        return decision.num_draft_tokens, not decision.speculating and decision.num_draft_tokens == 0

    def _cut(self, new_tokens: list[int], num_generated: int, max_new: int) -> tuple[list[int], str]:
        """Truncate a round's tokens at EOS (kept) or at max_new_tokens; returns (tokens, finish reason or '')."""
        for index, token in enumerate(new_tokens):
            if token in self._eos_ids and num_generated + index < max_new:
                return new_tokens[:index + 1], 'stop'
        room = max_new - num_generated
        if len(new_tokens) >= room:
            return new_tokens[:room], 'length'
        return new_tokens, ''

    def _stats(self, run: _Run, started: float, first_token_at: float, finished: float) -> GenerationStats:
        tally, generated = run.tally, run.generated
        decode_time = run.last_emit - first_token_at
        stats = GenerationStats(
            prompt_tokens=len(run.plan.prompt_ids), new_tokens=len(generated), target_passes=tally.target_passes,
            drafted_tokens=tally.drafted, accepted_tokens=tally.accepted,
            tau=len(generated) / tally.target_passes,
            acceptance_rate=tally.accepted / tally.drafted if tally.drafted else 0.0,
            per_position_acceptance=[a / d for a, d in zip(tally.accepted_at, tally.drafted_at, strict=True)],
            mean_num_draft_tokens=tally.drafted / tally.rounds if tally.rounds else 0.0,
            draft_cost_ratio=self._cost_ratio(run.controller) if run.controller is not None else 0.0,
            drafter='none' if run.controller is None else run.plan.drafter, paused_rounds=tally.paused_rounds,
            time_to_first_token=first_token_at - started,
            inter_token_latency_p50=_percentile(tally.token_gaps, 0.5),
            inter_token_latency_p95=_percentile(tally.token_gaps, 0.95),
            tokens_per_second=(len(generated) - 1) / decode_time if decode_time > 0 else 0.0,
            wall_time=finished - started, peak_memory_bytes=peak_rss_bytes())
        if self._device.type == 'cuda':
            stats.cuda_allocated_bytes = torch.cuda.max_memory_allocated(self._device)
            stats.cuda_reserved_bytes = torch.cuda.max_memory_reserved(self._device)
        return stats


def _check_config(config: EngineConfig) -> None:
    if config.drafter not in DRAFTERS:
        raise ValueError('unknown drafter {!r}; choose one of {}'.format(config.drafter, ', '.join(DRAFTERS)))
    if config.drafter == 'mtp' and not config.assistant_path:
        raise ValueError("drafter 'mtp' needs engine.assistant_path (a Gemma4AssistantForCausalLM directory)")
    if config.drafter == 'draft' and not config.draft_model_path:
        raise ValueError("drafter 'draft' needs engine.draft_model_path (a smaller Gemma4ForCausalLM directory)")
    if config.max_draft_tokens < 1:
        raise ValueError('max_draft_tokens must be >= 1, got {}'.format(config.max_draft_tokens))
    if not 0 <= config.num_draft_tokens <= config.max_draft_tokens:
        raise ValueError('num_draft_tokens must be between 0 (adaptive) and max_draft_tokens={}, got {}'.format(
            config.max_draft_tokens, config.num_draft_tokens))
    if not 1 <= config.max_new_tokens <= config.max_new_tokens_limit:
        raise ValueError('max_new_tokens must be between 1 and max_new_tokens_limit={}, got {}'.format(
            config.max_new_tokens_limit, config.max_new_tokens))
    if config.probe_interval < 1:
        raise ValueError('probe_interval must be >= 1, got {}'.format(config.probe_interval))

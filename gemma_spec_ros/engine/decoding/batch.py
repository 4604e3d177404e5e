"""
Continuous batching (engine.max_batch > 1): goals decoded together, one target pass per round for all of them.

A goal's generate() call hands it to the scheduler thread and waits. Between rounds the scheduler admits waiting
goals (each prompt is prefilled into a free KV-cache slot) and drops finished and cancelled ones; a round then
drafts per goal, verifies every goal's drafts in one batched target pass (runtime/rows.py: row b in slot b, rows
padded to the longest), and accepts, rolls back and streams per goal. Nothing waits for the whole batch to end.

Each goal keeps its own sampling parameters and seed (its own generator: a seeded goal gives the same tokens
whatever shares its batch), stop strings, max tokens, grammar and stream. Drafters that joined the batch
(Drafter.join_batch: every drafter on the fast path) run here: a goal's drafter is its own (Drafter.for_batch),
and the goals whose drafters share a model draft together, a step for all their rows at once (DraftRows). A goal
whose drafter did not join (transformers' forward) runs one at a time on the single-goal path, which shares the
rounds' lock: it runs between rounds, and the batch waits for it.

In a batch, K is the goal's pinned K, else BATCH_NUM_DRAFT_TOKENS: the single-goal controller's costs and profit
gate are measured on unbatched passes, which a batched pass does not cost.
"""

import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from ..drafters.base import DraftContext, Drafter, Proposal, RowRequest
from ..logits.grammar import mask_logits
from ..logits.verify import verify
from ..runtime import FastCausalLM, GraphJob
from ..runtime.model import StepOutput
from ..runtime.rows import FastRows, row_bucket
from ..types import CancelToken, DeltaCallback, GenerationResult
from .run import Run

BATCH_NUM_DRAFT_TOKENS = 4
CLOSED_REASON = 'the engine was closed'


@dataclass(eq=False)
class BatchGoal:
    """One goal in the scheduler: its generation state, its slot, and how its caller waits."""

    run: Run
    on_delta: DeltaCallback | None
    cancel: CancelToken | None
    started: float
    steps_before: tuple[int, int]
    slot: int = -1                                   # its KV-cache slot once admitted
    proposal: Proposal | None = None                 # this round's drafts
    drafts: list[int] = field(default_factory=list)  # ... as token ids
    done: threading.Event = field(default_factory=threading.Event)
    result: GenerationResult | None = None
    error: BaseException | None = None


class BatchScheduler:
    """Runs the rounds of up to rows.cache.num_slots goals at once, in a thread of its own (started on first use)."""

    def __init__(self, engine, rows: FastRows, round_lock: threading.Lock, drafters: set[str],
                 graph_jobs: list[GraphJob]):
        """drafters: the names of the drafters that joined the batch (Drafter.join_batch); graph_jobs: its graphs."""
        self._engine = engine          # decoding.Engine: its emit / verify / result steps serve both paths
        self.rows = rows
        self._drafters = drafters
        self.graph_jobs = graph_jobs   # the batched steps' graphs, for the engine's warm-up
        self._round_lock = round_lock  # also held by a single-goal generation, for the whole of it
        self._condition = threading.Condition()
        self._waiting: deque[BatchGoal] = deque()
        self._slots: list[BatchGoal | None] = [None] * rows.cache.num_slots
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def num_slots(self) -> int:
        return len(self._slots)

    def takes(self, drafter: Drafter) -> bool:
        """Whether a goal with this drafter is decoded in the batch (else it runs on the single-goal path)."""
        return drafter.name in self._drafters

    def generate(self, run: Run, on_delta: DeltaCallback | None, cancel: CancelToken | None,
                 steps_before: tuple[int, int]) -> GenerationResult:
        """Decode one goal in the batch; returns when it ends (raises what its decoding raised)."""
        goal = BatchGoal(run, on_delta, cancel, time.perf_counter(), steps_before)
        with self._condition:
            if self._closed:
                raise RuntimeError(CLOSED_REASON)
            self._waiting.append(goal)
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name='gemma_spec_batch', daemon=True)
                self._thread.start()
            self._condition.notify()
        goal.done.wait()
        if goal.error is not None:
            raise goal.error
        return goal.result

    # ----------------------------------------------------------------------------------------------- the loop
    def close(self, timeout: float) -> None:
        """
        Stop the scheduler once its goals have ended; goals still waiting for a slot end with an error.

        Its thread holds the engine: stopping it lets a dropped engine free its models.
        """
        with self._condition:
            self._closed = True
            waiting, self._waiting = list(self._waiting), deque()
            self._condition.notify_all()
        for goal in waiting:
            goal.error = RuntimeError(CLOSED_REASON)
            goal.done.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _serve(self) -> None:
        while True:
            with self._condition:
                self._condition.wait_for(lambda: self._waiting or any(self._slots) or self._closed)
                if self._closed and not any(self._slots):
                    return
            with self._round_lock, torch.inference_mode():
                self._admit()
                goals = [goal for goal in self._slots if goal is not None]
                if not goals:
                    continue
                try:
                    self._run_round(goals)
                except Exception as exc:  # noqa: BLE001 (a failed pass fails its goals; the scheduler serves on)
                    for goal in goals:
                        if not goal.done.is_set():
                            self._end(goal, exc)

    def _admit(self) -> None:
        """Give waiting goals the free slots (lowest first, which keeps the rows few), prefilling each."""
        while True:
            with self._condition:
                free = next((slot for slot, goal in enumerate(self._slots) if goal is None), None)
                if free is None or not self._waiting:
                    return
                goal = self._waiting.popleft()
                goal.slot = free
                self._slots[free] = goal
            try:
                goal.run.drafter = goal.run.drafter.for_batch(free)
                if goal.cancel is not None and goal.cancel.cancelled:  # cancelled while it waited: nothing runs
                    goal.run.finish = 'cancelled'
                    self._end(goal)
                    continue
                self._prefill(goal)
            except Exception as exc:  # noqa: BLE001 (the goal's caller gets it; the others go on)
                self._end(goal, exc)

    def _prefill(self, goal: BatchGoal) -> None:
        """Put the goal's prompt into its slot and pick (and stream) its first token."""
        engine, run = self._engine, goal.run
        engine._call_drafter(run, lambda: run.drafter.start(run.tokens))
        out = self.rows.prefill(goal.slot, torch.tensor([run.tokens], device=engine._device))
        engine._call_drafter(run, lambda: run.drafter.observe(out, 1, 1))  # out holds the last prompt position
        logits = out.logits[0, -1:]  # [1, vocab]
        if run.constraint is not None:
            logits = mask_logits(logits, run.constraint.next_mask(engine._device))
        run.last_token = engine._first_token(logits, run.plan.sampling, run.generator)
        run.tally.add_prefill(time.perf_counter())
        self._emit(goal, [run.last_token.item()])

    def _run_round(self, goals: list[BatchGoal]) -> None:
        """Draft per goal, verify every goal in one batched pass, then accept, roll back and stream per goal."""
        engine, rows = self._engine, self.rows
        if engine._warmup is not None:
            engine._warmup.adopt()  # graphs built since the last round take over: the whole round runs on them
        batch = row_bucket(max(goal.slot for goal in goals) + 1, self.num_slots)
        self._propose(goals, batch)
        width = max(1 + len(goal.drafts) for goal in goals)
        token_rows, starts = [[0] * width for _ in range(batch)], [0] * batch  # idle rows: any token, position 0
        for goal in goals:
            row = [goal.run.tokens[-1]] + goal.drafts
            token_rows[goal.slot] = row + [0] * (width - len(row))
            starts[goal.slot] = rows.cache.slots[goal.slot].length
        token_ids = torch.tensor(token_rows, device=engine._device)
        out = rows.step(token_ids, starts)  # logits, hidden [batch, width, ...]
        # every row's greedy verdict at once: padding drafts of -1 are never accepted
        drafts = torch.tensor([goal_drafts + [-1] * (width - 1 - len(goal_drafts)) for goal_drafts in
                               self._drafts_by_row(goals, batch)], dtype=torch.long, device=engine._device)
        num_accepted, next_tokens = verify(drafts, out.logits, None, greedy=True)
        greedy = list(zip(num_accepted.tolist(), next_tokens.tolist(), strict=True))  # the round's host sync
        for goal in goals:
            try:
                self._accept(goal, out, greedy[goal.slot], starts[goal.slot], width)
            except Exception as exc:  # noqa: BLE001 (the goal's caller gets it; the others go on)
                self._end(goal, exc)

    def _propose(self, goals: list[BatchGoal], batch: int) -> None:
        """Each goal's drafts for this round: on its own, or with the goals whose drafters share a model."""
        engine, shared = self._engine, {}
        for goal in goals:
            run = goal.run
            goal.proposal, goal.drafts = None, []
            budget = min(run.plan.max_new_tokens - len(run.generated), engine._context_limit - len(run.tokens)) - 1
            k = min(run.plan.pinned_k or BATCH_NUM_DRAFT_TOKENS, budget, self.rows.max_query - 1)
            if k <= 0:
                continue
            context = DraftContext(run.tokens, run.last_token, run.plan.sampling, run.generator, 0.0, run.constraint)
            if run.drafter.rows is None:
                goal.proposal = engine._call_drafter(run, lambda run=run, context=context, k=k:
                                                     run.drafter.propose(context, k))
            else:
                shared.setdefault(run.drafter.rows, []).append((goal, RowRequest(goal.slot, context, k, run.drafter)))
        for drafter_rows, members in shared.items():
            try:
                proposals = drafter_rows.propose_rows([request for _, request in members], batch)
            except Exception as exc:  # noqa: BLE001 (a drafter failure: its goals go on with plain decoding)
                for goal, _ in members:
                    goal.run.fall_back(self._engine._drafters['none'], exc)
                continue
            for (goal, _), proposal in zip(members, proposals, strict=True):
                goal.proposal = proposal
        for goal in goals:
            if goal.proposal is not None:
                goal.drafts = goal.proposal.tokens.tolist()

    @staticmethod
    def _drafts_by_row(goals: list[BatchGoal], batch: int) -> list[list[int]]:
        by_row: list[list[int]] = [[] for _ in range(batch)]
        for goal in goals:
            by_row[goal.slot] = goal.drafts
        return by_row

    def _accept(self, goal: BatchGoal, out: StepOutput, greedy: tuple[int, int], start: int, width: int) -> None:
        """Verify the goal's drafts (greedy: its row's greedy verdict); keep the accepted K/V; stream."""
        engine, run, slot, drafts = self._engine, goal.run, goal.slot, goal.drafts
        if run.plan.sampling.greedy and run.constraint is None:
            accepted, next_token = greedy
            run.last_token = torch.tensor([next_token], device=engine._device)
        else:  # sampled or under a grammar: the goal's own verification, with its generator
            draft_tokens = run.last_token[:0] if goal.proposal is None else goal.proposal.tokens
            row = engine._verify(run, goal.proposal, draft_tokens, out.logits[slot, :len(drafts) + 1])
            run.last_token = row[-1:]
            accepted, next_token = row[0].item(), row[-1].item()
        cache = self.rows.cache.slots[slot]
        cache.advance(start, width)                 # the whole padded row was written ...
        cache.crop(-(width - accepted - 1))         # ... the last token and the accepted drafts stay
        own_pass = StepOutput(out.logits[slot:slot + 1, :len(drafts) + 1], out.hidden[slot:slot + 1, :len(drafts) + 1])
        engine._call_drafter(run, lambda: run.drafter.observe(own_pass, len(drafts) + 1, accepted + 1))
        run.tally.add_round(len(drafts), accepted, time.perf_counter())
        self._emit(goal, drafts[:accepted] + [next_token])

    def _emit(self, goal: BatchGoal, new_tokens: list[int]) -> None:
        """Stream the goal's new tokens; end it when they finish it or it was cancelled."""
        engine, run = self._engine, goal.run
        engine._emit(run, new_tokens, goal.on_delta)
        if not run.finish and goal.cancel is not None and goal.cancel.cancelled:
            tail = engine._release_held_text(run)
            if tail:
                engine._send(run, tail, [], goal.on_delta)
            run.finish = 'cancelled'
        if run.finish:
            self._end(goal)

    def _end(self, goal: BatchGoal, error: BaseException | None = None) -> None:
        """Free the goal's slot and wake its caller with its result (or error)."""
        with self._condition:
            if goal.slot >= 0 and self._slots[goal.slot] is goal:
                self._slots[goal.slot] = None
        try:
            if error is None:
                goal.result = self._engine._result(goal.run, goal.started, goal.steps_before)
        except Exception as exc:  # noqa: BLE001 (its caller gets it, never a wait without end)
            error = exc
        goal.error = error
        goal.done.set()


def start_batching(engine, target_lm, drafters: dict[str, Drafter]) -> BatchScheduler | None:
    """
    Set up an engine's continuous batching: None unless engine.max_batch > 1 and the target runs the fast path.

    The target's batched steps (a slot per goal) and the drafters that join; their graphs, the target's first,
    then the default drafter's, then the others'.
    """
    config = engine.config
    if config.max_batch == 1 or not isinstance(target_lm, FastCausalLM):
        return None
    rows = FastRows(target_lm.lean, target_lm.mode, config.max_batch, engine._context_limit, target_lm.max_query)
    joined = {name: drafter.join_batch(rows) for name, drafter in drafters.items()}
    joined = {name: jobs for name, jobs in joined.items() if jobs is not None}
    jobs = rows.graph_jobs('target batch') + joined.get(config.drafter, []) + [
        job for name, drafter_jobs in joined.items() if name != config.drafter for job in drafter_jobs]
    return BatchScheduler(engine, rows, engine._lock, set(joined), jobs)

"""
Continuous batching (engine.max_batch > 1): goals decoded together, one target pass per round for all of them.

A goal's generate() call hands it to the scheduler thread and waits. Between rounds the scheduler admits waiting
goals (each prompt is prefilled into a free KV-cache slot) and drops finished and cancelled ones; a round then
drafts per goal, verifies every goal's drafts in one batched target pass (runtime/steps/rows.py: row b in slot b, rows
padded to the longest), and accepts, rolls back and streams per goal. Nothing waits for the whole batch to end.

Each goal keeps its own sampling parameters and seed (its own generator: a seeded goal gives the same tokens
whatever shares its batch), stop strings, max tokens, grammar and stream. Drafters that joined the batch
(Drafter.join_batch: every drafter on the fast path) run here: a goal's drafter is its own (Drafter.for_batch),
and the goals whose drafters share a model draft together, a step for all their rows at once (DraftRows). A goal
whose drafter did not join (transformers' forward) runs one at a time on the single-goal path, which shares the
rounds' lock: it runs between rounds, and the batch waits for it.

Each goal that speculates without a pinned K has a SpeculationController of its own (the single-goal engine's rule:
the best K, the profit gate, the cut-off), fed with its own acceptance and drafting time and with its share of the
batched passes (control.GoalPassCost), which are timed per row bucket and query length (calibrated at load, then
every round). A goal whose drafter does not pay drops to plain rounds; the others go on speculating.
"""

import random
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from .. import config_checks
from ..control import Decision, GoalPassCost, SpeculationController, TargetCost
from ..drafters.base import Drafter, Proposal, RowRequest
from ..logits.verify import verify
from ..runtime import FastCausalLM, GraphJob
from ..runtime.model.forward import StepOutput
from ..runtime.steps.rows import FastRows, row_bucket, row_buckets, slot_nbytes
from ..stats import tau
from ..types import BatchGoalStatus, CancelToken, DeltaCallback, GenerationResult
from .rounds import Rounds
from .run import Run

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
    admitted: float | None = None                    # when it got its slot
    # its controllers (an auto goal: one per member) with their pools, where each goes when it ends (its
    # drafter's), and their share of the batched passes
    leases: dict[SpeculationController, tuple[list, GoalPassCost]] = field(default_factory=dict)
    decision: Decision = field(default_factory=lambda: Decision(0, True))  # this round's K
    proposal: Proposal | None = None                 # this round's drafts
    drafts: list[int] = field(default_factory=list)  # ... as token ids
    draft_seconds: float = 0.0                       # ... and what drafting them cost it
    width: int = 1                                   # its row's tokens last round (1 + drafts)
    done: threading.Event = field(default_factory=threading.Event)
    result: GenerationResult | None = None
    error: BaseException | None = None


class BatchScheduler:
    """Runs the rounds of up to rows.cache.num_slots goals at once, in a thread of its own (started on first use)."""

    def __init__(self, rounds: Rounds, rows: FastRows, round_lock: threading.Lock, drafters: set[str],
                 graph_jobs: list[GraphJob], adopt_built_graphs, prefix_cache=None):
        """
        Schedule goals on rows, each round's steps taken from rounds (which the single-goal path runs too).

        drafters: the names of the drafters that joined the batch (Drafter.join_batch); graph_jobs: its graphs;
        adopt_built_graphs: lets graphs a background warm-up built take over, between rounds; prefix_cache: the
        target's runtime.PrefixCache, which the single-goal path shares (None: every prompt prefilled).
        """
        self._prefix = prefix_cache
        self._rounds = rounds
        self._adopt_built_graphs = adopt_built_graphs
        self.rows = rows
        self._drafters = drafters
        self.graph_jobs = graph_jobs   # the batched steps' graphs, for the engine's warm-up
        self._round_lock = round_lock  # also held by a single-goal generation, for the whole of it
        self._condition = threading.Condition()
        self._waiting: deque[BatchGoal] = deque()
        self._slots: list[BatchGoal | None] = [None] * rows.cache.num_slots
        # a batched pass's seconds by its query length, per row bucket: what the goals' controllers share
        self.pass_costs = {bucket: TargetCost(rows.max_query) for bucket in row_buckets(rows.cache.num_slots)}
        # per drafter: the controllers (and their pass shares) of its goals that ended, for its next goals
        self._idle_controllers: dict[Drafter, list[tuple[SpeculationController, GoalPassCost]]] = {}
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def num_slots(self) -> int:
        return len(self._slots)

    def status_fields(self) -> dict:
        """EngineStatus's batch fields: the target's KV cache per slot, the slots, and the goals in the batch now."""
        return {'kv_cache_slot_bytes': self.rows.cache.slot_nbytes, 'batch_slots': self.num_slots,
                'batch_goals': self.goal_statuses()}

    def goal_statuses(self) -> list[BatchGoalStatus]:
        """Return the goals in the batch now, by slot: the K, τ and wait of each (safe from any thread)."""
        with self._condition:
            goals = [goal for goal in self._slots if goal is not None and goal.admitted is not None]
        return [BatchGoalStatus(goal.slot, goal.run.drafter.name, goal.decision.num_draft_tokens,
                                goal.decision.speculating, tau(len(goal.run.generated), goal.run.tally.target_passes),
                                len(goal.run.generated), goal.admitted - goal.started) for goal in goals]

    def takes(self, run: Run) -> bool:
        """Whether a goal with these drafters is decoded in the batch (else it runs on the single-goal path)."""
        return all(drafter.name in self._drafters for drafter in run.drafters())

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

    def calibrate(self, rounds: int, context: int) -> dict[int, dict[int, float]]:
        """
        Time batched passes of every row bucket and query length, and start each bucket's cost curve there.

        Medians of rounds (the sizes shuffled per round), each row after context positions of its slot or after
        its goal's tokens: a pass writes past every slot's length, where nothing is kept (as a padded row), so it
        may run while goals wait between rounds. Returns the median seconds per bucket and query length.
        """
        order, medians = random.Random(0), {}
        start = max(0, min(context, self.rows.cache.context_limit - self.rows.max_query))
        with self._round_lock, torch.inference_mode():
            for bucket, pass_cost in self.pass_costs.items():
                sizes, samples = list(range(1, self.rows.max_query + 1)), {}
                starts = [max(start, slot.length) for slot in self.rows.cache.slots[:bucket]]
                for _ in range(rounds):
                    order.shuffle(sizes)
                    for q in sizes:
                        started = time.perf_counter()
                        self.rows.step(torch.zeros((bucket, q), dtype=torch.long, device=self._rounds.device),
                                       starts).logits.sum().item()  # the round's sync
                        samples.setdefault(q, []).append(time.perf_counter() - started)
                medians[bucket] = {q: statistics.median(times) for q, times in samples.items()}
                pass_cost.calibrate(medians[bucket])
        return medians

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
                goal.admitted = time.perf_counter()
                self._join(goal, free)
                if goal.cancel is not None and goal.cancel.cancelled:  # cancelled while it waited: nothing runs
                    goal.run.finish = 'cancelled'
                    self._end(goal)
                    continue
                self._prefill(goal)
            except Exception as exc:  # noqa: BLE001 (the goal's caller gets it; the others go on)
                self._end(goal, exc)

    def _join(self, goal: BatchGoal, slot: int) -> None:
        """Give the goal its slot's drafters (Drafter.for_batch) and, where it speculates, controllers of its own."""
        run = goal.run
        if run.auto is not None:  # each member, with a controller of its own
            for name, drafter in run.auto.for_batch(slot).items():
                run.auto.controllers[name] = self._lease(goal, drafter, run.auto.drafters[name])
            return
        drafter = run.drafter
        run.drafter = drafter.for_batch(slot)
        if run.controller is not None:  # not drafter none, nor one whose model failed to load
            run.controller = self._lease(goal, drafter, run.drafter)

    def _lease(self, goal: BatchGoal, drafter: Drafter, own: Drafter) -> SpeculationController:
        """
        Return a controller of the goal's own for drafter (own: the goal's drafter of it), on its pass share.

        One that an earlier goal of its drafter left, if any: what it learned of the drafter's acceptance and
        drafting cost carries over, as the single-goal engine's one controller per drafter does (not that one: its
        costs are single-goal passes). A pinned K is only measured, as on the single-goal path.
        """
        pool = self._idle_controllers.setdefault(drafter, [])
        if pool:
            controller, pass_cost = pool.pop()
        else:
            pass_cost = GoalPassCost(self.pass_costs[row_bucket(goal.slot + 1, self.num_slots)])
            controller = self._rounds.new_controller(own, pass_cost)
        goal.leases[controller] = pool, pass_cost
        return controller

    def _prefill(self, goal: BatchGoal) -> None:
        """Put the goal's prompt into its slot and pick (and stream) its first token."""
        run = goal.run
        self._rounds.start(run)
        out, run.tally.cached_prompt_tokens = self.rows.prefill_prompt(
            goal.slot, torch.tensor([run.tokens], device=self._rounds.device), self._prefix)
        self._emit(goal, self._rounds.first_token(run, out))

    def _run_round(self, goals: list[BatchGoal]) -> None:
        """Draft per goal, verify every goal in one batched pass, then accept, roll back and stream per goal."""
        rows, device = self.rows, self._rounds.device
        self._adopt_built_graphs()
        batch = row_bucket(max(goal.slot for goal in goals) + 1, self.num_slots)
        self._propose(goals, batch)
        width = max(goal.width for goal in goals)
        token_rows, starts = [[0] * width for _ in range(batch)], [0] * batch  # idle rows: any token, position 0
        for goal in goals:
            row = [goal.run.tokens[-1]] + goal.drafts
            token_rows[goal.slot] = row + [0] * (width - len(row))
            starts[goal.slot] = rows.cache.slots[goal.slot].length
        token_ids = torch.tensor(token_rows, device=device)
        drafts = torch.tensor([goal_drafts + [-1] * (width - 1 - len(goal_drafts)) for goal_drafts in
                               self._drafts_by_row(goals, batch)], dtype=torch.long, device=device)
        started = time.perf_counter()
        out = rows.step(token_ids, starts)  # logits, hidden [batch, width, ...]
        # every row's greedy verdict at once: padding drafts of -1 are never accepted
        num_accepted, next_tokens = verify(drafts, out.logits, None, greedy=True)
        greedy = list(zip(num_accepted.tolist(), next_tokens.tolist(), strict=True))  # the round's host sync
        self.pass_costs[batch].record(width, time.perf_counter() - started)
        for goal in goals:
            try:
                self._accept(goal, out, greedy[goal.slot], starts[goal.slot], width)
            except Exception as exc:  # noqa: BLE001 (the goal's caller gets it; the others go on)
                self._end(goal, exc)

    def _propose(self, goals: list[BatchGoal], batch: int) -> None:
        """Each goal's drafts for this round: on its own, or with the goals whose drafters share a model."""
        rounds, shared = self._rounds, {}
        for goal in goals:
            run = goal.run
            goal.proposal, goal.drafts, goal.draft_seconds = None, [], 0.0
            self._share_pass(goal, goals, batch)
            goal.decision, k = rounds.plan(run, self.rows.max_query - 1)
            if k <= 0:
                continue
            if run.drafter.rows is None:
                started = time.perf_counter()
                goal.proposal = rounds.propose(run, goal.decision, k)
                goal.draft_seconds = time.perf_counter() - started
            else:
                shared.setdefault(run.drafter.rows, []).append(
                    (goal, RowRequest(goal.slot, rounds.draft_context(run, goal.decision), k, run.drafter)))
        for drafter_rows, members in shared.items():
            started = time.perf_counter()
            try:
                proposals = drafter_rows.propose_rows([request for _, request in members], batch)
            except Exception as exc:  # noqa: BLE001 (a drafter failure: its goals go on with plain decoding)
                for goal, _ in members:
                    rounds.fall_back(goal.run, exc)
                continue
            seconds = (time.perf_counter() - started) / len(members)  # the rows' steps ran once for all of them
            for (goal, _), proposal in zip(members, proposals, strict=True):
                goal.proposal, goal.draft_seconds = proposal, seconds
        for goal in goals:
            if goal.proposal is not None:
                goal.drafts = goal.proposal.tokens.tolist()
            goal.width = 1 + len(goal.drafts)

    def _share_pass(self, goal: BatchGoal, goals: list[BatchGoal], batch: int) -> None:
        """Price a speculating goal's verify passes at its share of this round's batched pass."""
        if not goal.leases:
            return
        others = [other for other in goals if other is not goal]
        partners = [other for other in others if self._speculates_as_it_chooses(other)]
        for _, pass_cost in goal.leases.values():
            pass_cost.share(self.pass_costs[batch], len(goals), len(partners),
                            [other.width for other in others if other not in partners])

    @staticmethod
    def _speculates_as_it_chooses(goal: BatchGoal) -> bool:
        """Whether the goal's controller chooses its K and speculates now (its gate is open; K not pinned)."""
        controller = goal.run.controller
        return controller is not None and not goal.run.plan.pinned_k and controller.speculating

    @staticmethod
    def _drafts_by_row(goals: list[BatchGoal], batch: int) -> list[list[int]]:
        by_row: list[list[int]] = [[] for _ in range(batch)]
        for goal in goals:
            by_row[goal.slot] = goal.drafts
        return by_row

    def _accept(self, goal: BatchGoal, out: StepOutput, greedy: tuple[int, int], start: int, width: int) -> None:
        """Verify the goal's drafts (greedy: its row's greedy verdict); keep the accepted K/V; stream."""
        rounds, run, slot, drafts = self._rounds, goal.run, goal.slot, goal.drafts
        accept_started = time.perf_counter()
        if rounds.takes_pass_verdict(run):
            verdict = [greedy[0], *drafts, greedy[1]]
        else:  # sampled or under a grammar: the goal's own verification, with its generator
            verdict = rounds.verify(run, goal.proposal, out.logits[slot, :len(drafts) + 1]).tolist()
        cache = self.rows.cache.slots[slot]
        cache.advance(start, width)                 # the whole padded row was written ...
        cache.crop(-(width - verdict[0] - 1))       # ... the last token and the accepted drafts stay
        own_pass = StepOutput(out.logits[slot:slot + 1, :len(drafts) + 1], out.hidden[slot:slot + 1, :len(drafts) + 1])
        new_tokens = rounds.accept(run, goal.proposal, own_pass, verdict)
        for _, pass_cost in goal.leases.values():
            pass_cost.record_pass(goal.width)
        if run.speculates:  # its drafting, its share of the pass, its own work
            share = goal.leases[run.controller][1].last_seconds if run.controller in goal.leases else None
            rounds.record(run, goal.proposal, verdict[0], goal.draft_seconds, goal.draft_seconds + (
                share or 0.0) + time.perf_counter() - accept_started)
        self._emit(goal, new_tokens)

    def _emit(self, goal: BatchGoal, new_tokens: list[int]) -> None:
        """Stream the goal's new tokens; end it when they finish it or it was cancelled."""
        if self._rounds.emit(goal.run, new_tokens, goal.on_delta, goal.cancel):
            self._end(goal)

    def _end(self, goal: BatchGoal, error: BaseException | None = None) -> None:
        """Free the goal's slot and wake its caller with its result (or error)."""
        with self._condition:
            if goal.slot >= 0 and self._slots[goal.slot] is goal:
                self._slots[goal.slot] = None
        try:
            if error is None:
                goal.result = self._rounds.result(goal.run, goal.started, goal.steps_before, self.rows.mode)
        except Exception as exc:  # noqa: BLE001 (its caller gets it, never a wait without end)
            error = exc
        kept = {controller for _, controller in goal.run.speculators()}  # not after a drafter failure
        for controller, (pool, pass_cost) in goal.leases.items():
            if controller in kept:
                pool.append((controller, pass_cost))
        goal.error = error
        goal.done.set()


def start_batching(rounds: Rounds, target_lm, drafters: dict[str, Drafter], round_lock: threading.Lock,
                   adopt_built_graphs, prefix_cache=None) -> BatchScheduler | None:
    """
    Set up an engine's continuous batching: None with engine.max_batch 1, or unless the target runs the fast path.

    The target's batched steps (a slot per goal: engine.max_batch, or with 0 as many as engine.batch_kv_budget_mb
    holds) and the drafters that join; their graphs, the target's first, then the default drafter's, then the
    others'. ValueError when the budget holds fewer than 2 slots.
    """
    config, context_limit = rounds.config, rounds.context_limit
    if config.max_batch == 1 or not isinstance(target_lm, FastCausalLM):
        return None
    slots = config.max_batch or config_checks.slots_within_budget(
        config, slot_nbytes(target_lm.lean, context_limit, target_lm.max_query), context_limit)
    rows = FastRows(target_lm.lean, target_lm.mode, slots, context_limit, target_lm.max_query)
    joined = {name: drafter.join_batch(rows) for name, drafter in drafters.items()}
    joined = {name: jobs for name, jobs in joined.items() if jobs is not None}
    jobs = rows.graph_jobs('target batch') + joined.get(config.drafter, []) + [
        job for name, drafter_jobs in joined.items() if name != config.drafter for job in drafter_jobs]
    return BatchScheduler(rounds, rows, round_lock, set(joined), jobs, adopt_built_graphs, prefix_cache)

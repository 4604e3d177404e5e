"""
The node's goal queue, free of ROS: fair admission, FIFO or preemption, cancels, time limits, orphaned goals.

Up to ``max_running`` goals run at once (the backend's ``Capabilities.max_concurrent_goals``: 1 for an engine that
serves one generation at a time, more for one that batches); up to ``max_waiting`` wait behind them. Every goal is
accepted; one that finds the queue full ends at once as busy (``Job.finish_reason == 'busy'``).

Fair admission (clients named by the goal's ``client_id``): a client refused as busy holds a claim for
``fair_claim`` seconds after its last refusal, or for CLAIM_PACE_FACTOR times its usual gap between a refusal and
its retry where that is longer (a loaded client or node takes seconds to deliver a refusal and send the retry; a
fixed life would drop such a client's claim before every retry and send it to the back each time). A free slot
goes to the claims in the order they were made, so a client that just got its result cannot take the slot back
ahead of clients that were refused; it queues a claim of its own. Waiting goals run round-robin: the next goal is
the oldest one of the client that started a goal least recently. Goals without a client_id count as one anonymous
client. Each running goal is on its own: a cancel, a time limit or an orphaned client stops that goal and leaves
the others running.

Preemption (policy 'preempt'): a new goal aborts every waiting goal and, when every running slot is held by a goal
that is not already stopping, the running goal that started first. The preempted goal hands its slot to the new
goal at once and stops within a round. With one slot that is nav2's rule: the new goal replaces the running one.

The node maps ActionServer callbacks onto these calls; its worker threads (one per running slot) take goals with
``take`` and a timer calls ``expire`` and ``drop_orphans``.
"""

import threading
import time
from collections import deque
from dataclasses import dataclass, field

from gemma_spec_ros.engine.types import CancelToken

HARD_LIMIT = 16   # waiting goals under the preempt policy, so that executor threads never run out
MAX_RUNNING_LIMIT = 64   # running slots at most (engine.max_batch's limit): each holds an executor thread too
SHUTDOWN_REASON = 'node is shutting down'
PREEMPTED_REASON = 'preempted by a newer goal (queue.policy preempt)'
ORPHANED_REASON = ('no client is left to receive this goal: every feedback and status subscriber present when it '
                   'was accepted has left the ROS graph')
LISTENER_GRACE = 2.0   # seconds after acceptance in which the goal's possible receivers are still collected
MAX_REMEMBERED_CLIENTS = 256
CLAIM_PACE_FACTOR = 2.0    # a claim outlives its client's usual refusal-to-retry gap by this factor
MAX_CLAIM_LIFE = 30.0      # s: the longest a claim lives, however slowly its client retries
PACE_WEIGHT = 0.5          # weight of the newest gap in a client's usual refusal-to-retry gap


@dataclass(eq=False)
class Job:
    """One accepted goal on its way through the queue."""

    key: bytes                                   # goal id
    handle: object = None                        # the ActionServer's goal handle (opaque here)
    client: str = ''                             # the goal's client_id ('' = anonymous)
    accepted_at: float = field(default_factory=time.monotonic)
    started_at: float = 0.0                      # when a worker took it (0 = it never ran)
    admitted: bool = False                       # holds a queue slot (False: refused as busy or shutting down)
    listeners: set = field(default_factory=set)  # graph endpoints (gids) that may receive the goal
    cancel: CancelToken = field(default_factory=CancelToken)
    done: threading.Event = field(default_factory=threading.Event)
    request: object = None                       # GenerationRequest
    plan: object = None                          # RequestPlan, once validated
    result: object = None                        # GenerationResult
    error: str = ''                              # why the goal failed
    finish_reason: str = ''                      # the node's reason, over the engine's: busy|timeout|cancelled
    client_cancelled: bool = False
    preempted: bool = False
    feedback_times: list = field(default_factory=list)  # (monotonic time, tokens) per feedback message

    def finish(self, error: str = '') -> None:
        self.error = self.error or error
        self.done.set()

    def stop(self, error: str, finish_reason: str) -> None:
        """End the goal for a node reason: it stops within a round when running (caller holds the queue lock)."""
        self.error = self.error or error
        self.finish_reason = self.finish_reason or finish_reason
        self.cancel.cancel()


class GoalQueue:
    """Thread-safe queue of Jobs with the node's admission, cancel and time rules."""

    def __init__(self, max_waiting: int = 4, policy: str = 'fifo', fair_claim: float = 2.0):
        self.max_waiting = max_waiting
        self.max_running = 1              # goals that run at once: set_max_running
        self.policy = policy
        self.fair_claim = fair_claim
        self._lock = threading.Condition()
        self.state = 'unconfigured'       # unconfigured|loading|inactive|ready|failed|shutdown
        self.reason = ''                  # why goals are refused (failed, inactive, shutting down)
        self._admitted = 0                # admitted goals whose execute callback has not returned
        self._waiting: deque[Job] = deque()
        self._running: list[Job] = []     # in the order they started
        self._jobs: dict[bytes, Job] = {}
        self._early_cancels: set[bytes] = set()
        self._claims: dict[str, float] = {}       # client -> last busy refusal, in the order claims were made
        self._refused: dict[str, float] = {}      # client -> last busy refusal, kept after its claim lapsed
        self._pace: dict[str, float] = {}         # client -> usual seconds from a busy refusal to its next goal
        self._last_start: dict[str, float] = {}   # client -> when its last goal started running

    # ---- the node's state: unconfigured -> loading -> inactive <-> ready; failed; shutdown
    def set_loading(self) -> bool:
        """Start loading (configure): goals accepted from now on wait until the node is active."""
        with self._lock:
            if self.state not in ('unconfigured', 'failed'):
                return False
            self.state, self.reason = 'loading', ''
            return True

    def set_ready(self) -> bool:
        """Serve goals (the node is active); False when the queue failed or shut down meanwhile."""
        with self._lock:
            if self.state not in ('loading', 'inactive'):
                return False
            self.state, self.reason = 'ready', ''
            self._lock.notify_all()
            return True

    def set_configured(self, reason: str) -> None:
        """Mark the backend open but not serving: new goals end with reason; loading-time goals wait to activate."""
        with self._lock:
            if self.state == 'loading':
                self.state, self.reason = 'inactive', reason

    def set_max_running(self, slots: int) -> int:
        """
        Run up to slots goals at once (1..MAX_RUNNING_LIMIT); return the number set.

        Fewer slots than goals running now: those finish, and no goal starts until the running ones fit.
        """
        with self._lock:
            self.max_running = max(1, min(int(slots), MAX_RUNNING_LIMIT))
            self._lock.notify_all()   # a larger number lets waiting goals start at once
            return self.max_running

    def set_inactive(self, reason: str, cancel_running: bool) -> None:
        """Stop serving (deactivate): new and waiting goals end with reason; running goals finish or stop."""
        self._stop_serving('inactive', reason, cancel_running)

    def set_unconfigured(self, reason: str) -> None:
        """Let go of the backend (cleanup): every goal ends with the reason, and so do new ones until configure."""
        self._stop_serving('unconfigured', reason, cancel_running=True)

    def set_failed(self, reason: str) -> None:
        """Mark the engine failed to load: every waiting goal ends with the reason, and so will new ones."""
        self._stop_serving('failed', reason, cancel_running=True)

    def _stop_serving(self, state: str, reason: str, cancel_running: bool) -> None:
        with self._lock:
            if self.state == 'shutdown':
                return
            self.state, self.reason = state, reason
            waiting = list(self._waiting)
            self._waiting.clear()
            for job in self._running if cancel_running else ():
                job.stop(reason, 'cancelled')
            self._lock.notify_all()
        for job in waiting:
            job.finish(reason)

    @property
    def limit(self) -> int:
        """Goals that may wait behind the running ones now."""
        return self.max_waiting if self.policy == 'fifo' else HARD_LIMIT

    # ---- ActionServer callbacks
    def register(self, key: bytes, handle=None, client: str = '', listeners=(), invalid: str = '',
                 now: float | None = None) -> Job:
        """
        Admit an accepted goal and return its Job.

        An invalid goal (invalid: why) takes no slot and is finished at once with that error. A goal refused for
        lack of room is finished too (finish_reason 'busy', the error says how full the queue is), and so is one
        that arrives at shutdown. A goal whose cancel arrived first is cancelled. listeners: graph endpoints
        present now that may receive the goal.
        """
        now = time.monotonic() if now is None else now
        job = Job(key, handle, client, accepted_at=now, listeners=set(listeners))
        with self._lock:
            self._jobs[key] = job
            if key in self._early_cancels:
                self._early_cancels.discard(key)
                job.client_cancelled = True
                job.cancel.cancel()
            if invalid:
                job.finish(invalid)
                return job
            refusal = self._refusal()
            busy = '' if refusal else self._busy(client, now)
            if refusal or busy:
                job.finish_reason = 'busy' if busy else ''
                job.finish(refusal or busy)
                return job
            job.admitted = True
            self._admitted += 1
            self._claims.pop(client, None)
        return job

    def _refusal(self) -> str:
        """Why a goal cannot be served in this state, or '' (lock held)."""
        if self.state in ('loading', 'ready'):
            return ''
        return self.reason or (SHUTDOWN_REASON if self.state == 'shutdown' else 'node is {}'.format(self.state))

    def _busy(self, client: str, now: float) -> str:
        """'' when the client's goal may take a slot, else why not (lock held); a refusal records a claim."""
        self._note_pace(client, now)
        for other, refused_at in list(self._claims.items()):
            if now - refused_at > self._claim_life(other):
                del self._claims[other]
        capacity = self.max_running + self.limit
        free = capacity - self._admitted
        ahead = []
        for other in self._claims:
            if other == client:
                break
            ahead.append(other)
        if len(ahead) < free:
            return ''
        if self.fair_claim > 0:
            self._claims[client] = now   # a client that already claims keeps its place
            self._refused[client] = now
            _forget_oldest(self._refused)
        taken = '{} of {} slots taken ({} running + up to queue.max_length {} waiting)'.format(
            self._admitted, capacity, self.max_running, self.limit)
        if free <= 0:
            return 'busy: {}; retry later'.format(taken)
        return 'busy: {}, and the free slot is held for {} client(s) refused earlier (queue.fair_claim {:g} s); ' \
               'retry later'.format(taken, len(ahead), self.fair_claim)

    def _note_pace(self, client: str, now: float) -> None:
        """Fold the gap since the client's last refusal into its usual refusal-to-retry gap (lock held)."""
        refused_at = self._refused.pop(client, None)
        if refused_at is None or now - refused_at > MAX_CLAIM_LIFE:   # not a retry: a later visit
            return
        gap, usual = now - refused_at, self._pace.pop(client, None)
        self._pace[client] = gap if usual is None else PACE_WEIGHT * gap + (1 - PACE_WEIGHT) * usual
        _forget_oldest(self._pace)

    def _claim_life(self, client: str) -> float:
        """Seconds a client's claim lives after its last refusal (lock held)."""
        return min(MAX_CLAIM_LIFE, max(self.fair_claim, CLAIM_PACE_FACTOR * self._pace.get(client, 0.0)))

    def job(self, key: bytes) -> Job:
        with self._lock:
            return self._jobs[key]

    def cancel(self, key: bytes) -> None:
        """Cancel a goal: a waiting goal leaves the queue, a running one stops within a round (the others run on)."""
        with self._lock:
            job = self._jobs.get(key)
            if job is None:
                self._early_cancels.add(key)
                return
            job.client_cancelled = True
            job.cancel.cancel()
            if job in self._waiting:
                self._waiting.remove(job)
                job.finish()

    def enqueue(self, job: Job) -> None:
        """Queue a job (its plan set, or None while the engine loads); ends it at once when it cannot run."""
        with self._lock:
            if job.client_cancelled or job.done.is_set():
                job.finish()
                return
            refusal = self._refusal()
            if refusal:
                job.finish(refusal)
                return
            if self.policy == 'preempt':
                self._preempt()
            self._waiting.append(job)
            self._lock.notify_all()

    def _preempt(self) -> None:
        """Make room for a newer goal: abort the waiting goals and, when no slot frees otherwise, the oldest running."""
        # a goal already stopping (cancelled, timed out, preempted) leaves its slot within a round on its own
        going_on = [job for job in self._running if not job.cancel.cancelled]
        oldest = going_on[0] if len(going_on) >= self.max_running else None
        for other in list(self._waiting) + ([oldest] if oldest is not None else []):
            other.preempted = True
            other.cancel.cancel()
        while self._waiting:
            self._waiting.popleft().finish(PREEMPTED_REASON)
        if oldest is not None:
            oldest.error = PREEMPTED_REASON

    def release(self, key: bytes) -> None:
        """Forget a goal whose execute callback returned."""
        with self._lock:
            job = self._jobs.pop(key, None)
            if job is not None and job.admitted:
                self._admitted -= 1
            self._lock.notify_all()

    # ---- supervision (a timer)
    def expire(self, goal_timeout: float, now: float | None = None) -> list[Job]:
        """End the goals accepted more than goal_timeout seconds ago (finish_reason 'timeout'); return them."""
        now = time.monotonic() if now is None else now
        with self._lock:
            late = [job for job in self._live() if now - job.accepted_at > goal_timeout]
            for job in late:
                ran = 'generated for {:.1f} s'.format(now - job.started_at) if job.started_at else 'never started'
                self._end(job, 'goal exceeded queue.goal_timeout = {:g} s (waited {:.1f} s, {}); partial text '
                          'kept'.format(goal_timeout, (job.started_at or now) - job.accepted_at, ran), 'timeout')
        return late

    def drop_orphans(self, present, now: float | None = None) -> list[Job]:
        """
        End the goals nobody can receive any more; return them.

        present: the graph endpoints that may receive goals now (the action's feedback and status subscribers).
        Within LISTENER_GRACE of its acceptance a goal collects them as its listeners; after that it is ended
        once none of its listeners is present. A goal that never had a listener is left alone.
        """
        now = time.monotonic() if now is None else now
        present = set(present)
        orphans = []
        with self._lock:
            for job in self._live():
                if now - job.accepted_at <= LISTENER_GRACE:
                    job.listeners |= present
                elif job.listeners and not job.listeners & present:
                    orphans.append(job)
                    self._end(job, ORPHANED_REASON, 'cancelled')
        return orphans

    def _live(self) -> list[Job]:
        return [job for job in self._jobs.values() if job.admitted and not job.done.is_set() and not job.error]

    def _end(self, job: Job, error: str, finish_reason: str) -> None:
        """End a waiting or running job for a node reason (lock held)."""
        job.stop(error, finish_reason)
        if job in self._waiting:
            self._waiting.remove(job)
            job.finish()

    # ---- workers
    def take(self) -> Job | None:
        """Block until a goal may run (engine ready, a slot free); return it (round-robin by client); None at end."""
        with self._lock:
            self._lock.wait_for(lambda: self.state == 'shutdown' or (
                self.state == 'ready' and self._waiting and self._slots_taken() < self.max_running))
            if self.state == 'shutdown':
                return None
            job = min(self._waiting, key=lambda j: (self._last_start.get(j.client, float('-inf')), j.accepted_at))
            self._waiting.remove(job)
            job.started_at = time.monotonic()
            self._last_start.pop(job.client, None)
            self._last_start[job.client] = job.started_at
            _forget_oldest(self._last_start)
            self._running.append(job)
            return job

    def _slots_taken(self) -> int:
        """Count the slots held (lock held): a preempted goal gave its slot to the newer one and only ends its round."""
        return sum(not job.preempted for job in self._running)

    def finished(self, job: Job) -> None:
        """Mark a running job done: its slot is free."""
        with self._lock:
            self._running.remove(job)
            self._lock.notify_all()
        job.finish()

    def depth(self) -> tuple[int, int]:
        """Return (waiting goals, running goals)."""
        with self._lock:
            return len(self._waiting), len(self._running)

    # ---- shutdown
    def shutdown(self, reason: str = SHUTDOWN_REASON) -> None:
        """Stop: waiting goals end with the reason, running ones are cancelled; new goals are refused."""
        with self._lock:
            if self.state == 'shutdown':
                return
            self.state, self.reason = 'shutdown', reason
            waiting = list(self._waiting)
            self._waiting.clear()
            for job in self._running:
                job.error = reason
                job.cancel.cancel()
            self._lock.notify_all()
        for job in waiting:
            job.finish(reason)

    def wait_until_idle(self, timeout: float) -> bool:
        """Wait until no goal runs; False on timeout."""
        with self._lock:
            return self._lock.wait_for(lambda: not self._running, timeout)

    def wait_until_released(self, timeout: float) -> bool:
        """Wait until every admitted goal's execute callback returned; False on timeout."""
        with self._lock:
            return self._lock.wait_for(lambda: self._admitted <= 0, timeout)


def _forget_oldest(by_client: dict[str, float]) -> None:
    """Keep at most MAX_REMEMBERED_CLIENTS clients: drop the one written longest ago (the first in the dict)."""
    if len(by_client) > MAX_REMEMBERED_CLIENTS:
        del by_client[next(iter(by_client))]

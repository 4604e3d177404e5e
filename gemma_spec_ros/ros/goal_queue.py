"""
The node's goal queue, free of ROS: fair admission, FIFO or preemption, cancels, time limits, orphaned goals.

One goal runs at a time (the engine serves one generation at a time); up to ``max_waiting`` wait behind it. Every
goal is accepted; one that finds the queue full ends at once as busy (``Job.finish_reason == 'busy'``).

Fair admission (clients named by the goal's ``client_id``): a client refused as busy holds a claim for
``fair_claim`` seconds after its last refusal. A free slot goes to the claims in the order they were made, so a
client that just got its result cannot take the slot back ahead of clients that were refused; it queues a claim
of its own. Waiting goals run round-robin: the next goal is the oldest one of the client that started a goal
least recently. Goals without a client_id count as one anonymous client.

The node maps ActionServer callbacks onto these calls; the worker thread takes goals with ``take`` and a timer
calls ``expire`` and ``drop_orphans``.
"""

import threading
import time
from collections import deque
from dataclasses import dataclass, field

from gemma_spec_ros.engine.types import CancelToken

HARD_LIMIT = 16   # waiting goals under the preempt policy, so that executor threads never run out
SHUTDOWN_REASON = 'node is shutting down'
PREEMPTED_REASON = 'preempted by a newer goal (queue.policy preempt)'
ORPHANED_REASON = ('no client is left to receive this goal: every feedback and status subscriber present when it '
                   'was accepted has left the ROS graph')
LISTENER_GRACE = 2.0   # seconds after acceptance in which the goal's possible receivers are still collected
MAX_REMEMBERED_CLIENTS = 256


@dataclass(eq=False)
class Job:
    """One accepted goal on its way through the queue."""

    key: bytes                                   # goal id
    handle: object = None                        # the ActionServer's goal handle (opaque here)
    client: str = ''                             # the goal's client_id ('' = anonymous)
    accepted_at: float = field(default_factory=time.monotonic)
    started_at: float = 0.0                      # when the worker took it (0 = it never ran)
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
        self.policy = policy
        self.fair_claim = fair_claim
        self._lock = threading.Condition()
        self.state = 'unconfigured'       # unconfigured|loading|inactive|ready|failed|shutdown
        self.reason = ''                  # why goals are refused (failed, inactive, shutting down)
        self._admitted = 0                # admitted goals whose execute callback has not returned
        self._waiting: deque[Job] = deque()
        self._running: Job | None = None
        self._jobs: dict[bytes, Job] = {}
        self._early_cancels: set[bytes] = set()
        self._claims: dict[str, float] = {}       # client -> last busy refusal, in the order claims were made
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

    def set_inactive(self, reason: str, cancel_running: bool) -> None:
        """Stop serving (deactivate): new and waiting goals end with reason; the running one finishes or stops."""
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
            if self._running is not None and cancel_running:
                self._running.stop(reason, 'cancelled')
            self._lock.notify_all()
        for job in waiting:
            job.finish(reason)

    @property
    def limit(self) -> int:
        """Goals that may wait behind the running one now."""
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
        for other, refused_at in list(self._claims.items()):
            if now - refused_at > self.fair_claim:
                del self._claims[other]
        capacity = 1 + self.limit
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
        taken = '{} of {} slots taken (1 running + up to queue.max_length {} waiting)'.format(
            self._admitted, capacity, self.limit)
        if free <= 0:
            return 'busy: {}; retry later'.format(taken)
        return 'busy: {}, and the free slot is held for {} client(s) refused earlier (queue.fair_claim {:g} s); ' \
               'retry later'.format(taken, len(ahead), self.fair_claim)

    def job(self, key: bytes) -> Job:
        with self._lock:
            return self._jobs[key]

    def cancel(self, key: bytes) -> None:
        """Cancel a goal: a waiting goal leaves the queue, the running one stops within a round."""
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
                self._preempt_all()
            self._waiting.append(job)
            self._lock.notify_all()

    def _preempt_all(self) -> None:
        """Abort the running and waiting goals in favour of a newer one (lock held)."""
        for other in list(self._waiting) + ([self._running] if self._running else []):
            other.preempted = True
            other.cancel.cancel()
        while self._waiting:
            self._waiting.popleft().finish(PREEMPTED_REASON)
        if self._running is not None:
            self._running.error = PREEMPTED_REASON

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

    # ---- worker
    def take(self) -> Job | None:
        """Block until a goal may run (engine ready) and return it (round-robin by client); None once shut down."""
        with self._lock:
            while self.state != 'shutdown' and not (self.state == 'ready' and self._waiting):
                self._lock.wait()
            if self.state == 'shutdown':
                return None
            job = min(self._waiting, key=lambda j: (self._last_start.get(j.client, float('-inf')), j.accepted_at))
            self._waiting.remove(job)
            job.started_at = time.monotonic()
            self._last_start[job.client] = job.started_at
            if len(self._last_start) > MAX_REMEMBERED_CLIENTS:
                del self._last_start[min(self._last_start, key=self._last_start.get)]
            self._running = job
            return job

    def finished(self, job: Job) -> None:
        """Mark the running job done."""
        with self._lock:
            self._running = None
            self._lock.notify_all()
        job.finish()

    def depth(self) -> tuple[int, bool]:
        """Return (waiting goals, whether one is running)."""
        with self._lock:
            return len(self._waiting), self._running is not None

    # ---- shutdown
    def shutdown(self, reason: str = SHUTDOWN_REASON) -> None:
        """Stop: waiting goals end with the reason, the running one is cancelled; new goals are refused."""
        with self._lock:
            if self.state == 'shutdown':
                return
            self.state, self.reason = 'shutdown', reason
            waiting = list(self._waiting)
            self._waiting.clear()
            if self._running is not None:
                self._running.error = reason
                self._running.cancel.cancel()
            self._lock.notify_all()
        for job in waiting:
            job.finish(reason)

    def wait_until_idle(self, timeout: float) -> bool:
        """Wait until no goal runs; False on timeout."""
        with self._lock:
            return self._lock.wait_for(lambda: self._running is None, timeout)

    def wait_until_released(self, timeout: float) -> bool:
        """Wait until every admitted goal's execute callback returned; False on timeout."""
        with self._lock:
            return self._lock.wait_for(lambda: self._admitted <= 0, timeout)

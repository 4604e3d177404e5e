"""
The node's goal queue, free of ROS: admission, FIFO or preemption, early cancels, engine state and shutdown.

One goal runs at a time (the engine serves one generation at a time); up to ``max_waiting`` wait behind it. The
node maps ActionServer callbacks onto these calls; the worker thread takes goals with ``take``.
"""

import threading
import time
from collections import deque
from dataclasses import dataclass, field

from gemma_spec_ros.engine.types import CancelToken

HARD_LIMIT = 16   # waiting goals under the preempt policy, so that executor threads never run out
SHUTDOWN_REASON = 'node is shutting down'
PREEMPTED_REASON = 'preempted by a newer goal (queue.policy preempt)'


@dataclass(eq=False)
class Job:
    """One accepted goal on its way through the queue."""

    key: bytes                                   # goal id
    handle: object = None                        # the ActionServer's goal handle (opaque here)
    cancel: CancelToken = field(default_factory=CancelToken)
    done: threading.Event = field(default_factory=threading.Event)
    request: object = None                       # GenerationRequest
    plan: object = None                          # RequestPlan, once validated
    result: object = None                        # GenerationResult
    error: str = ''                              # why the goal failed
    client_cancelled: bool = False
    preempted: bool = False
    feedback_times: list = field(default_factory=list)  # (monotonic time, tokens) per feedback message

    def finish(self, error: str = '') -> None:
        self.error = self.error or error
        self.done.set()


class GoalQueue:
    """Thread-safe queue of Jobs with the node's admission and cancel rules."""

    def __init__(self, max_waiting: int = 4, policy: str = 'fifo'):
        self.max_waiting = max_waiting
        self.policy = policy
        self._lock = threading.Condition()
        self.state = 'loading'            # loading|ready|failed|shutdown
        self.reason = ''                  # why failed / shutting down
        self._admitted = 0                # accepted goals whose execute callback has not returned
        self._waiting: deque[Job] = deque()
        self._running: Job | None = None
        self._jobs: dict[bytes, Job] = {}
        self._early_cancels: set[bytes] = set()

    # ---- engine state
    def set_ready(self) -> bool:
        """Mark the engine loaded; False when the queue already failed or shut down."""
        with self._lock:
            if self.state != 'loading':
                return False
            self.state = 'ready'
            self._lock.notify_all()
            return True

    def set_failed(self, reason: str) -> None:
        """Mark the engine failed: every waiting goal ends with the reason, and so will new ones."""
        with self._lock:
            if self.state == 'loading':
                self.state, self.reason = 'failed', reason
            waiting = list(self._waiting)
            self._waiting.clear()
        for job in waiting:
            job.finish(reason)

    # ---- ActionServer callbacks
    def admit(self) -> str:
        """'' when a new goal may be accepted, else why not (busy or shutting down)."""
        with self._lock:
            if self.state == 'shutdown':
                return SHUTDOWN_REASON
            limit = self.max_waiting if self.policy == 'fifo' else HARD_LIMIT
            if self._admitted >= 1 + limit:
                return 'busy: {} goals running or waiting (queue.max_length {})'.format(self._admitted, limit)
            self._admitted += 1
            return ''

    def register(self, key: bytes, handle=None) -> Job:
        """Register an accepted goal and return its Job (already cancelled when the cancel arrived first)."""
        job = Job(key, handle)
        with self._lock:
            self._jobs[key] = job
            if key in self._early_cancels:
                self._early_cancels.discard(key)
                job.client_cancelled = True
                job.cancel.cancel()
        return job

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
            if job.client_cancelled:
                job.finish()
                return
            if self.state in ('failed', 'shutdown'):
                job.finish(self.reason or SHUTDOWN_REASON)
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
            self._jobs.pop(key, None)
            self._admitted -= 1
            self._lock.notify_all()

    # ---- worker
    def take(self) -> Job | None:
        """Block until a goal may run (engine ready) and return it; None once shut down."""
        with self._lock:
            while self.state != 'shutdown' and not (self.state == 'ready' and self._waiting):
                self._lock.wait()
            if self.state == 'shutdown':
                return None
            self._running = self._waiting.popleft()
            return self._running

    def finished(self, job: Job) -> None:
        """Mark the running job done."""
        with self._lock:
            self._running = None
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

    def wait_until_released(self, timeout: float) -> bool:
        """Wait until every accepted goal's execute callback returned; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._admitted > 0:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._lock.wait(remaining)
            return True

"""
Warm-up of the decode steps: compile before serving (blocking), or serve at once while graphs compile (background).

- ``background`` (default): the engine serves its first request on eager steps at once. A worker thread, at a lower
  priority, compiles the step graphs one at a time on shadows of the models (fast/runner.py: GraphJob), which never
  touch the caches that serve. Each graph is taken over between rounds (adopt, called by the decode loop), so a
  round runs on one set of steps. The next graph is the one the served requests ran eager most often for; before
  any request, the target's one-token step, then the default drafter's graphs, then the rest.
- ``blocking``: every graph is compiled or captured before the first request (minutes with a cold compile cache).
- ``off``: no warm-up; a graph is compiled the first time a request needs it, inside that request.

Only CPU inductor graphs build in the background. CUDA graphs are captured in seconds and CUDA inductor's graphs
bind the cache they were compiled on, so on CUDA background warms up as blocking does.
"""

import os
import threading
import time
from collections.abc import Callable

import torch

from .fast import GraphJob
from .fast.runner import INDUCTOR_MODES, compile_cache_dir
from .types import WarmupState

BACKGROUND_NICE = 10  # the worker's scheduling priority below the serving thread's (Linux: per thread)


class Warmup:
    """
    The background warm-up of an engine's step graphs: a worker thread builds them, the decode loop adopts them.

    jobs: every graph to build, in the order wanted before any request (order_jobs), the first default_path of
    them the target's and the default drafter's. on_compiled: called in the worker once those serve (the engine
    times its verify passes again then).
    """

    def __init__(self, jobs: list[GraphJob], say: Callable[[str], None],
                 on_compiled: Callable[[], None] | None = None, default_path: int = 0):
        self._pending = list(jobs)
        self._default_path = set(jobs[:default_path])
        self._default_path_done: float | None = None
        self._total = len(jobs)
        self._ready = 0
        self._failed: list[str] = []
        self._steps = list({id(job.steps): job.steps for job in jobs}.values())
        self._say = say
        self._on_compiled = on_compiled
        self._stop = threading.Event()
        self._started = time.perf_counter()
        self._finished: float | None = None
        self._thread: threading.Thread | None = None
        self._use_graphs: bool | None = None  # a change of use_graphs, applied at the next adopt
        self.jobs = tuple(jobs)
        for job in jobs:
            job.steps.serve_eager = True

    def start(self) -> None:
        """Start building in a worker thread (daemon: a process may exit while it compiles)."""
        self._started = time.perf_counter()
        threads = torch.get_num_threads()  # compiled CPU kernels keep the thread count they were compiled for
        self._thread = threading.Thread(target=self._work, args=(threads,), name='gemma_spec_warmup', daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 0.0) -> None:
        """Build no further graph; wait up to timeout seconds for the one in progress."""
        self._stop.set()
        if self._thread is not None and timeout > 0:
            self._thread.join(timeout)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every graph is built (or the worker stopped); True when done."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self._finished is not None

    @property
    def pending(self) -> tuple[GraphJob, ...]:
        """The graphs not built yet."""
        return tuple(self._pending)

    def use_graphs(self, enabled: bool) -> None:
        """
        Serve on the graphs built so far (True, the default) or on eager steps only, from the next round on.

        For comparing the two paths in one process (bench: warm-up speed against full speed).
        """
        self._use_graphs = enabled

    def adopt(self) -> None:
        """Take over the graphs built so far (the decode loop calls this between rounds)."""
        use_graphs, self._use_graphs = self._use_graphs, None
        for steps in self._steps:
            steps.adopt()
            if use_graphs is not None:
                steps.use_graphs = use_graphs

    def state(self) -> WarmupState:
        end = self._finished if self._finished is not None else time.perf_counter()
        default_path = None if self._default_path_done is None else self._default_path_done - self._started
        return WarmupState('background', self._ready, self._total, end - self._started, default_path,
                           self._finished is not None, list(self._failed))

    def build_next(self) -> bool:
        """Build the graph most wanted now (in the calling thread); False when none is left."""
        if not self._pending:
            return False
        self.build(max(self._pending, key=lambda candidate: (candidate.demand, -self._pending.index(candidate))))
        return True

    def build(self, job: GraphJob) -> None:
        """Build one pending graph in the calling thread and stage it; the decode loop adopts it between rounds."""
        self._pending.remove(job)
        started = time.perf_counter()
        try:
            built = job.build()
        except Exception as exc:  # noqa: BLE001 (a graph that fails to build leaves its steps eager)
            self._failed.append(job.name)
            self._say('warm-up: {} failed ({}: {}); its steps stay eager'.format(job.name, type(exc).__name__, exc))
        else:
            self._ready += 1
            self._say('warm-up: {} ready{} ({} of {} graphs, {:.1f} s for it, {:.0f} s so far)'.format(
                job.name, '' if built else ' but not callable directly (stays eager)', self._ready, self._total,
                time.perf_counter() - started, time.perf_counter() - self._started))
        if not any(other.owner is job.owner for other in self._pending):
            job.owner.release_shadow()
        if self._default_path_done is None and self._default_path.isdisjoint(self._pending):
            self._default_path_done = time.perf_counter()
            if self._pending:
                self._say('warm-up: the target and the default drafter run compiled after {:.1f} s; {} graphs of '
                          'other drafters follow'.format(self._default_path_done - self._started, len(self._pending)))
            if self._on_compiled is not None:
                self._on_compiled()
        if not self._pending:
            self._finish()

    def _work(self, threads: int) -> None:
        torch.set_num_threads(threads)
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
        except (AttributeError, OSError):  # not Linux, or not allowed: the same priority
            pass
        while not self._stop.is_set() and self.build_next():
            pass

    def _finish(self) -> None:
        self._finished = time.perf_counter()
        self._say('warm-up: full speed after {:.1f} s ({} graphs{})'.format(
            self._finished - self._started, self._ready,
            ', {} failed'.format(len(self._failed)) if self._failed else ''))


def order_jobs(target_jobs: list[GraphJob], drafter_jobs: dict[str, list[GraphJob]], default_drafter: str
               ) -> tuple[list[GraphJob], int]:
    """
    Order the jobs as wanted before any request: the target's one-token step, the default drafter's, the rest.

    Returns them and how many lead: the target's and the default drafter's (the default path).
    """
    others = [job for name, jobs in drafter_jobs.items() if name != default_drafter for job in jobs]
    default_path = target_jobs[:1] + drafter_jobs.get(default_drafter, []) + target_jobs[1:]
    return default_path + others, len(default_path)


def warm_up_blocking(target_lm, drafters: dict, say: Callable[[str], None]) -> WarmupState:
    """Compile or capture the decode steps of the target and every drafter before the first request."""
    started = time.perf_counter()
    if target_lm.mode in INDUCTOR_MODES:
        say('warm-up: compiling the decode steps ({}) before serving; a cold compile cache ({}) takes minutes on '
            'a small CPU'.format(target_lm.mode, compile_cache_dir()))
    elif target_lm.mode == 'cudagraph':
        say('warm-up: capturing the decode steps as CUDA graphs')
    graphs = target_lm.warmup(logits_to_keep=0, progress=say).graphs
    for drafter in drafters.values():
        graphs += drafter.warmup(say)
    return WarmupState('blocking', graphs, graphs, time.perf_counter() - started)

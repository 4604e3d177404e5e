"""
Warm-up of the decode steps: compile before serving (blocking), or serve at once while graphs compile (background).

- ``background`` (default): the engine serves its first request on eager steps at once. A worker thread builds the
  step graphs one at a time on shadows of the models (runtime/runner.py: GraphJob), which never touch the caches that
  serve. Each graph is taken over between rounds (adopt, called by the decode loop), so a round runs on one set of
  steps. The next graph is the one the served requests ran eager most often for; before any request, the target's
  one-token step, then the default drafter's graphs, then the rest.
  Compiling a graph is mostly Python (tracing, inductor's scheduling) and holds the GIL for most of a minute, which
  would slow the eager steps that serve meanwhile many times over. So a compile process (CompileProcess: the same
  models, at a lower priority) compiles each graph first into inductor's on-disk cache, and the worker thread then
  builds it from there in seconds. Without the process (it failed to start or died) the worker compiles itself.
- ``blocking``: every graph is compiled or captured before the first request (minutes with a cold compile cache).
- ``off``: no warm-up; a graph is compiled the first time a request needs it, inside that request.

Only CPU inductor graphs build in the background. CUDA graphs are captured in seconds and CUDA inductor's graphs
bind the cache they were compiled on, so on CUDA background warms up as blocking does.
"""

import atexit
import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable

import torch

from ...stats import mib, process_rss_bytes
from ...types import EngineConfig, WarmupState
from ..ops.compile_cache import compile_cache_dir
from .runner import GraphJob
from .tables import INDUCTOR_MODES

BACKGROUND_NICE = 10  # the compile process's and the worker's scheduling priority below the serving thread's
# How long stopping waits for the graph being built: a graph built from the compile cache takes seconds, one compiled
# in this process (no compile process) up to a minute. The engine's close waits so that the models the worker holds
# can be freed; interpreter exit waits because a daemon thread still inside torch's C++ when the interpreter
# finalizes aborts the process ('terminate called without an active exception').
STOP_WAIT_SECONDS = 90.0



class CompileProcess:
    """
    A child process with the engine's models that compiles the graphs it is asked for into inductor's on-disk cache.

    It runs at a lower priority and holds its own GIL (compile_worker). Protocol, a line each: the child says
    ``ready`` once loaded; the parent sends a graph's name, the child answers ``built NAME`` or ``failed NAME: why``.
    It exits when its standard input closes or the thread that started it ends.
    """

    def __init__(self, config: EngineConfig, module: str):
        """Start `python -m module` (the layer that loads an Engine names it); wait_ready() waits for its models."""
        self._process = subprocess.Popen(
            [sys.executable, '-m', module, json.dumps(dataclasses.asdict(config)), str(os.getpid())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1)

    def wait_ready(self) -> bool:
        """Wait until the process has loaded the models; False when it ended first."""
        try:
            return self._answer() == 'ready'
        except (OSError, ValueError):  # closed by stop() from another thread
            return False

    def request(self, name: str) -> bool:
        """Ask for one graph (answered by result); False when the process is gone."""
        try:
            self._process.stdin.write(name + '\n')
            self._process.stdin.flush()
        except (OSError, ValueError):  # gone, or closed by stop() from another thread
            return False
        return True

    def result(self, name: str) -> str:
        """Wait for the graph asked for last: '' once it is in the cache, else why not."""
        try:
            answer = self._answer()
        except (OSError, ValueError):
            answer = ''
        return '' if answer == 'built ' + name else answer or 'the compile process exited'

    @property
    def alive(self) -> bool:
        return self._process.poll() is None

    def close(self) -> None:
        if self._process.poll() is None:
            self._process.kill()
        self._process.wait()

    def _answer(self) -> str:
        return self._process.stdout.readline().strip()


class Warmup:
    """
    The background warm-up of an engine's step graphs: a worker thread builds them, the decode loop adopts them.

    jobs: every graph to build, in the order wanted before any request (order_jobs), the first default_path of
    them the target's and the default drafter's. on_compiled: called in the worker once those serve (the engine
    times its verify passes again then). compile_process: the engine's config and the module to run, for a
    CompileProcess that compiles each graph before the worker builds it (None: the worker compiles).
    """

    def __init__(self, jobs: list[GraphJob], progress: Callable[[str], None],
                 on_compiled: Callable[[], None] | None = None, default_path: int = 0,
                 compile_process: tuple[EngineConfig, str] | None = None):
        self._pending = list(jobs)
        self._default_path = set(jobs[:default_path])
        self._default_path_done: float | None = None
        self._total = len(jobs)
        self._ready = 0
        self._failed: list[str] = []
        self._steps = list({id(job.steps): job.steps for job in jobs}.values())
        self._progress = progress
        self._on_compiled = on_compiled
        self._compile_process_config = compile_process
        self._compiler: CompileProcess | None = None
        self._stop = threading.Event()
        self._started = time.perf_counter()
        # each built graph stays resident (its code, guards, torch's metadata of it): the log says how much
        self._rss_started = process_rss_bytes()
        self._finished: float | None = None
        self._thread: threading.Thread | None = None
        self._use_graphs: bool | None = None  # a change of use_graphs, applied at the next adopt
        self.jobs = tuple(jobs)
        for job in jobs:
            job.steps.serve_eager = True

    def start(self) -> None:
        """Start building in a worker thread (daemon: a process may exit while it compiles)."""
        self._started = time.perf_counter()
        self._rss_started = process_rss_bytes()
        threads = torch.get_num_threads()  # compiled CPU kernels keep the thread count they were compiled for
        self._thread = threading.Thread(target=self._work, args=(threads,), name='gemma_spec_warmup', daemon=True)
        self._thread.start()
        atexit.register(_stop_before_exit, weakref.ref(self))

    def stop(self, timeout: float = 0.0) -> None:
        """Build no further graph and end the compile process; wait up to timeout seconds for the worker."""
        self._stop.set()
        compiler = self._compiler
        if compiler is not None:
            compiler.close()
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
        self.build(self._most_wanted())
        return True

    def _most_wanted(self) -> GraphJob:
        return max(self._pending, key=self._wanted)

    def _wanted(self, job: GraphJob) -> tuple[int, int]:
        """Demand first, then the order before requests."""
        return job.demand, -self._pending.index(job)

    def build(self, job: GraphJob) -> None:
        """Build one pending graph in the calling thread and stage it; the decode loop adopts it between rounds."""
        self._pending.remove(job)
        started = time.perf_counter()
        try:
            built = job.build()
        except Exception as exc:  # noqa: BLE001 (a graph that fails to build leaves its steps eager)
            self._failed.append(job.name)
            self._progress('warm-up: {} failed ({}: {}); its steps stay eager'.format(
                job.name, type(exc).__name__, exc))
        else:
            self._ready += 1
            self._progress('warm-up: {} ready{} ({} of {} graphs, {:.1f} s for it, {:.0f} s so far, process RSS '
                           '{:.0f} MiB)'.format(job.name, '' if built else ' but not callable directly (stays eager)',
                                                self._ready, self._total, time.perf_counter() - started,
                                                time.perf_counter() - self._started, mib(process_rss_bytes())))
        if not any(other.owner is job.owner for other in self._pending):
            job.owner.release_shadow()
        if self._default_path_done is None and self._default_path.isdisjoint(self._pending):
            self._default_path_done = time.perf_counter()
            if self._pending:
                self._progress('warm-up: the target and the default drafter run compiled after {:.1f} s; {} graphs of '
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
        if self._compile_process_config is not None:
            self._start_compiler()
        compiling = self._ask_compiler()  # the graph the compile process works on
        while not self._stop.is_set() and self._pending:
            job = compiling or self._most_wanted()
            if compiling is not None:
                why = self._compiler.result(job.name)
                if self._stop.is_set():
                    break
                if why:
                    self._progress('warm-up: the compile process did not build {} ({}); building it here'.format(
                        job.name, why))
                    if not self._compiler.alive:
                        self._compiler = None
            compiling = self._ask_compiler(besides=job)  # the next one compiles there while this one builds here
            self.build(job)
        if self._compiler is not None:
            self._compiler.close()

    def _ask_compiler(self, besides: GraphJob | None = None) -> GraphJob | None:
        """Ask the compile process for the most wanted graph other than besides; the graph, or None."""
        candidates = [job for job in self._pending if job is not besides]
        if self._compiler is None or not candidates:
            return None
        job = max(candidates, key=self._wanted)
        if not self._compiler.request(job.name):
            self._compiler = None
            return None
        return job

    def _start_compiler(self) -> None:
        try:
            self._compiler = CompileProcess(*self._compile_process_config)  # stop() can end it while it loads
        except OSError as exc:
            self._progress('warm-up: no compile process ({}); compiling in this process'.format(exc))
            return
        if self._stop.is_set() or not self._compiler.wait_ready():  # stopped before the process could be ended
            self._compiler.close()
            self._compiler = None
            if not self._stop.is_set():
                self._progress('warm-up: the compile process did not load the models; compiling in this process')

    def _finish(self) -> None:
        self._finished = time.perf_counter()
        self._progress('warm-up: full speed after {:.1f} s ({} graphs{}; process RSS {:.0f} -> {:.0f} MiB over the '
                       'warm-up, goals served meanwhile included)'.format(
                           self._finished - self._started, self._ready,
                           ', {} failed'.format(len(self._failed)) if self._failed else '', mib(self._rss_started),
                           mib(process_rss_bytes())))


def _stop_before_exit(warmup_ref: 'weakref.ref[Warmup]') -> None:
    warmup = warmup_ref()
    if warmup is None or warmup._thread is None or not warmup._thread.is_alive():
        return
    warmup._progress('warm-up: stopping before exit (the graph being built ends first)')
    warmup.stop(timeout=STOP_WAIT_SECONDS)


def step_calls(step_tables) -> tuple[int, int]:
    """Return the decode steps run so far (graph, eager) by step tables (steps._Steps of models with graphs)."""
    return sum(steps.graph_calls for steps in step_tables), sum(steps.eager_calls for steps in step_tables)


def decode_path(step_tables, before: tuple[int, int], mode: str) -> str:
    """Say what ran a request's decode steps since before (step_calls): mode, 'eager', or both with the share."""
    graph, eager = (now - then for now, then in zip(step_calls(step_tables), before, strict=True))
    if not step_tables or not eager:
        return mode
    if not graph:
        return 'eager (warming up)'
    return 'eager + {} ({:.0%} of steps compiled)'.format(mode, graph / (graph + eager))


def order_jobs(target_jobs: list[GraphJob], drafter_jobs: dict[str, list[GraphJob]], default_drafter: str
               ) -> tuple[list[GraphJob], int]:
    """
    Order the jobs as wanted before any request: the target's one-token step, the default drafter's, the rest.

    Returns them and how many lead: the target's and the default drafter's (the default path).
    """
    others = [job for name, jobs in drafter_jobs.items() if name != default_drafter for job in jobs]
    default_path = target_jobs[:1] + drafter_jobs.get(default_drafter, []) + target_jobs[1:]
    return default_path + others, len(default_path)


def warm_up_blocking(target_lm, drafters: dict, progress: Callable[[str], None], rows=None) -> WarmupState:
    """Compile or capture the decode steps of the target, every drafter and rows.FastRows (if batching)."""
    started = time.perf_counter()
    if target_lm.mode in INDUCTOR_MODES:
        progress('warm-up: compiling the decode steps ({}) before serving; a cold compile cache ({}) takes minutes on '
            'a small CPU'.format(target_lm.mode, compile_cache_dir()))
    elif target_lm.mode == 'cudagraph':
        progress('warm-up: capturing the decode steps as CUDA graphs')
    graphs = target_lm.warmup(logits_to_keep=0, progress=progress).graphs
    for drafter in drafters.values():
        graphs += drafter.warmup(progress)
    if rows is not None:
        graphs += rows.warmup(progress)
    return WarmupState('blocking', graphs, graphs, time.perf_counter() - started)


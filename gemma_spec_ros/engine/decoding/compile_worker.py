"""
The compile process of a background warm-up (runtime/steps/warmup.py's CompileProcess), run with -m.

``python -m gemma_spec_ros.engine.decoding.compile_worker``.

It loads the engine's models from the config it is given (JSON) and compiles each graph it is asked for on standard
input into inductor's on-disk cache, from which the serving process then builds it in seconds.
"""

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # prctl option (linux/prctl.h)


def _end_with_parent(parent_pid: int) -> None:
    """
    End this process with the thread that started it (PR_SET_PDEATHSIG), not after a compile or a model load.

    Set before the heavy imports; a parent already gone by then is not signalled, so the process checks.
    Ctrl-C in a terminal reaches the whole process group: it ends this process too, even if the parent's parent
    started it with SIGINT ignored.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the process ends when its standard input closes
        pass
    if os.getppid() != parent_pid:
        sys.exit(0)


def serve_compile_requests(config_json: str) -> None:
    """Answer the parent's requests on standard output: ready, then built NAME or failed NAME: why."""
    import dataclasses
    import json

    from ..runtime.steps.warmup import BACKGROUND_NICE
    from ..types import EngineConfig
    from .engine import Engine

    os.setpriority(os.PRIO_PROCESS, 0, max(BACKGROUND_NICE, os.getpriority(os.PRIO_PROCESS, 0)))
    config = EngineConfig(**json.loads(config_json))
    answers = os.fdopen(os.dup(1), 'w', buffering=1)
    os.dup2(2, 1)  # whatever else torch or a library prints must not reach the protocol

    engine = Engine.from_config(dataclasses.replace(config, warmup='off'))
    jobs = {job.name: job for job in engine.graph_jobs}
    answers.write('ready\n')
    for line in sys.stdin:
        name = line.strip()
        try:
            jobs[name].build()
        except Exception as exc:  # noqa: BLE001 (the parent compiles that graph itself)
            answers.write('failed {}: {}: {}\n'.format(name, type(exc).__name__, str(exc).replace('\n', ' ')))
        else:
            answers.write('built {}\n'.format(name))


if __name__ == '__main__':
    _end_with_parent(int(sys.argv[2]))
    serve_compile_requests(sys.argv[1])

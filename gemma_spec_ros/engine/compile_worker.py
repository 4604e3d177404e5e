"""
The compile process of a background warm-up (warmup.CompileProcess): ``python -m gemma_spec_ros.engine.compile_worker``.

It loads the engine's models from the config it is given (JSON) and compiles each graph it is asked for on standard
input into inductor's on-disk cache, from which the serving process then builds it in seconds.
"""

import ctypes
import dataclasses
import json
import os
import signal
import sys

from .engine import Engine
from .types import EngineConfig
from .warmup import BACKGROUND_NICE

PR_SET_PDEATHSIG = 1  # prctl option (linux/prctl.h)


def _end_with_parent() -> None:
    """Have Linux kill this process when the thread that started it ends (PR_SET_PDEATHSIG), not after a compile."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the process ends when its standard input closes
        pass


def serve_compile_requests(config: EngineConfig) -> None:
    """Answer the parent's requests on standard output: ready, then built NAME or failed NAME: why."""
    os.setpriority(os.PRIO_PROCESS, 0, max(BACKGROUND_NICE, os.getpriority(os.PRIO_PROCESS, 0)))
    _end_with_parent()
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
    serve_compile_requests(EngineConfig(**json.loads(sys.argv[1])))

"""The node caps glibc's malloc arenas at start (engine.backend.bound_heap_arenas), unless MALLOC_ARENA_MAX is set."""

import os
import subprocess
import sys

import pytest

CODE = 'from gemma_spec_ros.engine.backend import bound_heap_arenas; print(bound_heap_arenas())'


def _glibc() -> bool:
    try:
        return bool(os.confstr('CS_GNU_LIBC_VERSION'))
    except (ValueError, OSError):
        return False


@pytest.mark.skipif(not _glibc(), reason='glibc only: mallopt(M_ARENA_MAX)')
@pytest.mark.parametrize(('environment', 'expected'), [({}, 'True'), ({'MALLOC_ARENA_MAX': '4'}, 'False')])
def test_the_arena_cap_is_set_unless_the_environment_sets_one(environment, expected):
    env = {key: value for key, value in os.environ.items() if key != 'MALLOC_ARENA_MAX'}
    env.update(environment)
    run = subprocess.run([sys.executable, '-c', CODE], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == expected

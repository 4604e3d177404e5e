"""
Inductor's compile cache: where it lives, and what torch keeps in memory of each compile that the engine never uses.

Warm-up of target + draft + assistant takes minutes with a cold inductor cache and seconds with a warm one: torch's
FX-graph and AOTAutograd caches persist across processes and reboots in TORCHINDUCTOR_CACHE_DIR (compile_cache_dir).
"""

import gc
import linecache
import os
from pathlib import Path

from ...backend import return_freed_memory
from . import torch_internals


def compile_cache_dir() -> str:
    """
    Return inductor's cache directory: TORCHINDUCTOR_CACHE_DIR, set first to one under ~/.cache unless the user chose.

    torch's default, /tmp/torchinductor_$USER, is emptied at boot on many systems, and a cold cache costs minutes of
    compiling at the next start. Importing torch._inductor.config writes that default into the variable, so the
    default counts as unset.
    """
    chosen = os.environ.get('TORCHINDUCTOR_CACHE_DIR')
    if chosen is None or os.path.abspath(chosen) == os.path.abspath(torch_internals.torch_default_cache_dir()):
        home = Path(os.environ.get('XDG_CACHE_HOME') or Path.home() / '.cache')
        os.environ['TORCHINDUCTOR_CACHE_DIR'] = str(home / 'gemma_spec_ros' / 'torchinductor')
    return os.environ['TORCHINDUCTOR_CACHE_DIR']


def release_compile_garbage() -> None:
    """
    After a torch.compile: drop what torch keeps for uses the engine never makes, and collect the compile's cycles.

    torch.compiler keeps the bytes of every cache artifact it wrote or read (for torch.compiler.save_cache_artifacts,
    which the engine does not call), linecache the source files read for guard and node stack traces. Freed before
    the next graph compiles, that memory is reused by it; freed only at the end of warm-up, its fragments would stay
    resident and raise the serving peak (bench/fast_measure.py memory). What the heap then keeps free goes back to
    the OS.
    """
    torch_internals.clear_cache_artifacts()
    linecache.clearcache()
    gc.collect()
    return_freed_memory()

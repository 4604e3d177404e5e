"""
Attention of compiled CPU steps as one C++ op, torch.ops.gemma_spec.decode_attention (cpu_attention.cpp).

A decode step attends a few queries to a few hundred keys: a few microseconds of arithmetic, which aten's flash
attention surrounds with tens of microseconds of set-up a call (figures in docs/decode-path.md). The op computes
each query row alone with vectorised loops, so it is cheap to call and a row's result does not depend on how many
queries share the pass.

It is built once per machine and torch version with torch.utils.cpp_extension (a C++ compiler, about 15 s) into the
compile cache's directory, before a process first compiles a CPU step (ensure_built). Where it cannot be built, the
steps keep SDPA and `ensure_built` says why (once).
"""

import hashlib
import warnings
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name('cpu_attention.cpp')
VECTOR_WIDTH = 8  # floats in at::vec's Vectorized<float> with these flags (AVX2, NEON or its portable form)


def _cflags() -> list[str]:
    """-O3, and AVX2 for at::vec on an x86 CPU that has it (AVX-512 ones do); elsewhere at::vec's own default."""
    if torch.backends.cpu.get_cpu_capability() in ('AVX2', 'AVX512'):
        return ['-O3', '-mavx2', '-mfma', '-mf16c', '-DCPU_CAPABILITY_AVX2', '-DCPU_CAPABILITY=AVX2']
    return ['-O3']


class CpuAttentionWarning(UserWarning):
    """The op could not be built; compiled CPU steps use SDPA."""


_state = {'built': False, 'failure': ''}


def _register_fake() -> None:
    @torch.library.register_fake('gemma_spec::decode_attention')
    def _(query, keys, values, mask):
        return query.new_empty(query.shape[0], query.shape[1] * query.shape[2])


def ensure_built() -> bool:
    """Build and load the op unless done (or failed) before; whether compiled CPU steps can call it."""
    if _state['built'] or _state['failure']:
        return _state['built']
    from torch.utils import cpp_extension

    from .compile_cache import compile_cache_dir  # not at import: compile_cache imports the layers' modules

    flags = _cflags()
    key = SOURCE.read_bytes() + torch.__version__.encode() + ' '.join(flags).encode()
    digest = hashlib.sha256(key).hexdigest()[:16]
    directory = Path(compile_cache_dir()) / 'gemma_spec_extensions' / 'decode_attention_{}'.format(digest)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        cpp_extension.load(name='gemma_spec_decode_attention', sources=[str(SOURCE)], extra_cflags=flags,
                           build_directory=str(directory), is_python_module=False, verbose=False)
        _register_fake()
    except Exception as exc:  # noqa: BLE001 (no compiler, no headers, a failed build: SDPA serves)
        _state['failure'] = '{}: {}'.format(type(exc).__name__, str(exc).strip().splitlines()[-1] if str(exc) else '')
        warnings.warn('the CPU decode attention op could not be built ({}); compiled CPU steps use SDPA'.format(
            _state['failure']), CpuAttentionWarning, stacklevel=2)
        return False
    _state['built'] = True
    return True


def usable(query: torch.Tensor) -> bool:
    """Whether a compiled CPU step's attention of query runs the op (float32 queries of whole vectors, once built)."""
    return _state['built'] and query.dtype == torch.float32 and query.shape[-1] % VECTOR_WIDTH == 0


def decode_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Attend query [q, heads, d] to keys/values [kv_heads, L, d] where mask [q, L] -> [q, heads * d] (scale 1)."""
    return torch.ops.gemma_spec.decode_attention(query, keys, values, mask)

"""
The engine's C++ CPU ops, built on first use: torch.ops.gemma_spec.decode_attention and int8_linear.

- decode_attention (cpu_attention.cpp): attention of CPU steps and verify passes (layers._attends_through_op). A
  decode step attends a few queries to a few hundred keys: a few microseconds of arithmetic, which aten's flash
  attention surrounds with tens of microseconds of set-up a call (figures in docs/decode-path.md).
- int8_linear (int8_linear.cpp): float32 rows times int8 matrices with per-output scales (engine.quantization
  int8), for every CPU pass. It rounds each row to 16-bit integers per block of ACTIVATION_BLOCK inputs and sums
  exact integer products (madd), twice as fast as converting the weights to float32 (docs/quantization.md).
  Several matrices of one input run in one call; int8_feed_forward (same file) runs a layer's whole feed-forward
  block, and int4_linear multiplies int4 matrices (two levels a byte, a scale and a low per group) the same way.

Each computes a row alone in a fixed order, so a row's result does not depend on how many rows share the pass.
They are built together once per machine and torch version with torch.utils.cpp_extension (a C++ compiler, about
30 s) into the compile cache's directory: before a process first compiles a CPU step, or when an int8 model is
loaded on the CPU (ensure_built). Where they cannot be built, ensure_built says why (once) and the callers keep
SDPA and a float product over the same rounded rows and the converted int8 data (quantize.quantized_linear).
"""

import contextlib
import fcntl
import functools
import hashlib
import time
import warnings
from pathlib import Path

import torch

SOURCES = (Path(__file__).with_name('cpu_attention.cpp'), Path(__file__).with_name('int8_linear.cpp'))
HEADERS = (Path(__file__).with_name('lane_totals.h'),)  # part of the build's key: a changed header rebuilds
VECTOR_WIDTH = 8  # floats in at::vec's Vectorized<float> with these flags (AVX2, NEON or its portable form)
ACTIVATION_BLOCK = 32  # int8_linear's inputs per activation scale: the input width must be a multiple
OUTPUT_TILE = 8  # the ops' output block (OUTPUT_BLOCK): int4's tile, and int8's where not 1 (row-major)
# Longest wait for another process's build of the same ops (a build takes about 30 s here, minutes on a busy Orin);
# past it the fallbacks serve, so a builder that hangs (stopped, not dead) never stalls a start for ever.
BUILD_WAIT_S = 600.0


@functools.cache
def cpu_info() -> str:
    """Return the text of /proc/cpuinfo ('' where there is none), read once: the CPU's vendor and flags."""
    try:
        with open('/proc/cpuinfo') as cpuinfo:
            return cpuinfo.read()
    except OSError:
        return ''


def _cflags() -> list[str]:
    """
    -O3, and AVX2 for at::vec on an x86 CPU that has it (AVX-512 ones do); elsewhere at::vec's own default.

    OpenMP where torch has it: at::parallel_for is a header template that runs serially unless the op is compiled
    with OpenMP.

    Where the CPU has AVX-512 VNNI, int8_linear adds each block's second half of products with one instruction
    (vpdpwssd) instead of a multiply-add and an add: the same integer sums, so the same bits, 8 % less time for a
    step's products (Zen 4).
    """
    threads = ['-fopenmp'] if torch.backends.openmp.is_available() else []  # at::parallel_for's OpenMP form
    if torch.backends.cpu.get_cpu_capability() in ('AVX2', 'AVX512'):
        flags = ['-O3', '-mavx2', '-mfma', '-mf16c', '-DCPU_CAPABILITY_AVX2', '-DCPU_CAPABILITY=AVX2'] + threads
        return flags + (['-mavx512vl', '-mavx512vnni'] if 'avx512_vnni' in cpu_info().split() else [])
    return ['-O3'] + threads


class CpuOpsWarning(UserWarning):
    """The ops could not be built; CPU attention uses SDPA, int8 products a float product."""


_state = {'built': False, 'failure': ''}


def _register_fakes() -> None:
    @torch.library.register_fake('gemma_spec::decode_attention')
    def _(query, keys, values, mask):
        return query.new_empty(query.shape[0], query.shape[1] * query.shape[2])

    @torch.library.register_fake('gemma_spec::int8_linear')
    def _(x, weights, scales, tile):
        return x.new_empty(x.shape[0], sum(weight.shape[0] for weight in weights))

    @torch.library.register_fake('gemma_spec::int4_linear')
    def _(x, data, params):
        return x.new_empty(x.shape[0], sum(matrix.shape[0] for matrix in data))

    @torch.library.register_fake('gemma_spec::int8_feed_forward')
    def _(x, gate, gate_scales, up, up_scales, down, down_scales, tile):
        return x.new_empty(x.shape[0], down.shape[0])


def build_directory() -> Path:
    """Return where the ops of these sources, flags and torch version are built (in the compile cache)."""
    from .compile_cache import compile_cache_dir  # not at import: compile_cache imports the layers' modules

    key = b''.join(path.read_bytes() for path in SOURCES + HEADERS)
    key += torch.__version__.encode() + ' '.join(_cflags()).encode()
    digest = hashlib.sha256(key).hexdigest()[:16]
    return Path(compile_cache_dir()) / 'gemma_spec_extensions' / 'cpu_ops_{}'.format(digest)


@contextlib.contextmanager
def build_lock(directory: Path, wait_s: float):
    """
    Hold the build flock of directory, waiting at most wait_s (TimeoutError after), and remove a stale torch lock.

    torch's build lock is a plain file that a killed builder leaves behind, and cpp_extension.load then waits on it
    for ever. Every builder here holds this flock first, and the kernel drops a flock with its process, so under it
    a leftover 'lock' file has no live owner.
    """
    deadline = time.monotonic() + wait_s
    with open(directory / 'build.flock', 'w') as held:
        while True:
            try:
                fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError('another process held the build lock {} for over {:.0f} s'.format(
                        directory / 'build.flock', wait_s)) from None
                time.sleep(0.2)
        stale = directory / 'lock'
        if stale.exists():
            warnings.warn('removed the stale build lock {} (its builder was killed)'.format(stale), CpuOpsWarning,
                          stacklevel=4)
            stale.unlink(missing_ok=True)
        yield


def ensure_built() -> bool:
    """Build and load the ops unless done (or failed) before; whether they can be called."""
    if _state['built'] or _state['failure']:
        return _state['built']
    from torch.utils import cpp_extension

    try:
        directory = build_directory()
        directory.mkdir(parents=True, exist_ok=True)
        with build_lock(directory, BUILD_WAIT_S):
            cpp_extension.load(name='gemma_spec_cpu_ops', sources=[str(source) for source in SOURCES],
                               extra_cflags=_cflags(), extra_ldflags=[flag for flag in _cflags() if 'openmp' in flag],
                               build_directory=str(directory), is_python_module=False, verbose=False)
        _register_fakes()
    except Exception as exc:  # noqa: BLE001 (no compiler, no headers, a failed build, a hung builder: fallbacks serve)
        _state['failure'] = '{}: {}'.format(type(exc).__name__, str(exc).strip().splitlines()[-1] if str(exc) else '')
        warnings.warn('the CPU ops could not be built ({}); CPU attention uses SDPA and int8 products a float '
                      'product'.format(_state['failure']), CpuOpsWarning, stacklevel=2)
        return False
    _state['built'] = True
    return True


def attention_usable(query: torch.Tensor) -> bool:
    """Whether decode_attention takes query (float32, whole vectors; once built)."""
    return _state['built'] and query.dtype == torch.float32 and query.shape[-1] % VECTOR_WIDTH == 0


def decode_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Attend query [q, heads, d] to keys/values [kv_heads, L, d] where mask [q, L] -> [q, heads * d] (scale 1)."""
    return torch.ops.gemma_spec.decode_attention(query, keys, values, mask)


def int8_linear_usable(x: torch.Tensor) -> bool:
    """Whether int8_linear takes rows x [q, in] (CPU, float32, in a multiple of its blocks; once built)."""
    return (_state['built'] and x.device.type == 'cpu' and x.dtype == torch.float32
            and x.shape[-1] % ACTIVATION_BLOCK == 0)


def int8_linear(x: torch.Tensor, data: tuple[torch.Tensor, ...], scales: tuple[torch.Tensor, ...],
                tile: int) -> torch.Tensor:
    """
    Return x [q, in], rounded as the module says, times each int8 matrix [out_i, in]^T and scales: [q, sum out_i].

    Each matrix is stored in tiles of `tile` outputs (1: row-major; OUTPUT_TILE: for each tile and block of
    ACTIVATION_BLOCK inputs, the tile's outputs' bytes one after another, quantize.int8_tile).
    """
    return torch.ops.gemma_spec.int8_linear(x, list(data), list(scales), tile)


def int4_linear(x: torch.Tensor, data: tuple[torch.Tensor, ...], params: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """
    Return x [q, in], rounded as int8_linear rounds it, times each int4 matrix: [q, sum out_i].

    A matrix is data uint8 [out, in / 2] (byte j of a group of 32 inputs: level j in the low nibble, level 16 + j in
    the high one) and params float16 [out, in / 32, 2] (each group's scale and low: value = level * scale + low),
    both stored per tile of OUTPUT_TILE outputs as quantize._int4 writes them.
    """
    return torch.ops.gemma_spec.int4_linear(x, list(data), list(params))


def int8_feed_forward(x: torch.Tensor, gate: tuple[torch.Tensor, torch.Tensor], up: tuple[torch.Tensor, torch.Tensor],
                      down: tuple[torch.Tensor, torch.Tensor], tile: int) -> torch.Tensor:
    """
    Return down(gelu(gate(x)) * up(x)) for x [q, in], each matrix an int8 (data, scales) as int8_linear takes them.

    gelu is the tanh form; the products are int8_linear's (down's input rounded the same way). One call instead of
    two and the gate's own kernel: what a compiled step spends between ops is a noticeable share of a small model's.
    """
    return torch.ops.gemma_spec.int8_feed_forward(x, *gate, *up, *down, tile)

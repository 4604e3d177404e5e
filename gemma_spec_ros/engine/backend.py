"""
The backend interface: what serves a goal, whether the local speculative engine or a vLLM server.

The ROS node and its diagnostics see only this interface (factory.open_backend picks the implementation from
engine.backend). Every backend takes the same GenerationRequest and either honours each field or refuses it in
validate() with a ValueError that names the field; its results carry the same GenerationStats, with tau and
acceptance as engine.stats defines them.
"""

import abc
import ctypes
import gc
import os
import sys
from dataclasses import dataclass

from .types import CancelToken, DeltaCallback, EngineStatus, GenerationRequest, GenerationResult


@dataclass(frozen=True)
class Capabilities:
    """What a goal may ask of a backend; fields a backend cannot honour are refused by its validate()."""

    backend: str                        # 'local' or 'vllm'
    drafters: tuple[str, ...]           # drafters a goal may name (besides '', the default)
    num_draft_tokens_per_goal: bool     # a goal may pin K (num_draft_tokens); else only 0 (the backend's K)
    structured_output: bool = True      # json_schema, grammar and json_free_whitespace
    loads_models: bool = True           # opening it loads models into this process (seconds to minutes)
    max_concurrent_goals: int = 1       # generate() calls it serves at once (from several threads); more wait
    image_refusal: str = 'this backend reads no images'  # why goals may not carry images; '' when they may

    @property
    def images(self) -> bool:
        """Whether a goal may carry images (GenerationRequest.images); else validate() refuses them."""
        return not self.image_refusal


class Backend(abc.ABC):
    """Serves GenerationRequests: validate, generate (streaming, cancellable), status; thread-safe."""

    @property
    @abc.abstractmethod
    def capabilities(self) -> Capabilities:
        """What goals may ask of this backend."""

    @property
    @abc.abstractmethod
    def device(self) -> str:
        """The device whose memory this process's models use ('cpu' when the models live in another process)."""

    @abc.abstractmethod
    def describe(self) -> str:
        """One line for the node's log: what serves the goals."""

    @abc.abstractmethod
    def validate(self, request: GenerationRequest):
        """Check a request without generating: the plan generate() takes, or ValueError naming the field."""

    @abc.abstractmethod
    def generate(self, request, on_delta: DeltaCallback | None = None,
                 cancel: CancelToken | None = None) -> GenerationResult:
        """
        Run a request (or a plan from validate): on_delta gets the text as it is decoded, cancel ends it.

        Returns finish_reason 'cancelled' with the partial text when cancelled, and 'error' with the reason in
        result.error when the backend failed mid-goal (a server gone); raises ValueError for an invalid request.
        """

    @abc.abstractmethod
    def status(self) -> EngineStatus:
        """Return a snapshot for diagnostics; may take a network timeout (a server backend asks its server)."""

    @abc.abstractmethod
    def set_default_drafter(self, name: str) -> None:
        """Set the drafter of goals that leave drafter empty; ValueError when this backend cannot run it."""

    @abc.abstractmethod
    def set_default_num_draft_tokens(self, k: int) -> None:
        """Set K of goals that leave num_draft_tokens 0 (0: adaptive, or the server's); ValueError if not allowed."""

    @property
    def warnings(self) -> list[str]:
        """Problems found while opening that leave the backend serving (a drafter that failed to load)."""
        return []

    @abc.abstractmethod
    def close(self) -> None:
        """Stop background work (a warm-up); goals already running finish."""


def is_fatal_error(error: BaseException) -> bool:
    """
    Whether an error raised by generate() leaves the backend unable to serve: out of memory, a device fault.

    Other errors end their goal only. Judged by type: MemoryError, torch.OutOfMemoryError and torch.AcceleratorError
    (a CUDA fault), looked up only where torch is loaded, so that this module needs none.
    """
    if isinstance(error, MemoryError):
        return True
    torch = sys.modules.get('torch')
    if torch is None:
        return False
    kinds = tuple(kind for kind in (getattr(torch, 'OutOfMemoryError', None), getattr(torch, 'AcceleratorError', None))
                  if kind is not None)
    if isinstance(error, kinds):
        return True
    # torch before 2.8 (JetPack 6 ships 2.5) raised a CUDA fault as a plain RuntimeError: the one test of a message
    return not hasattr(torch, 'AcceleratorError') and isinstance(error, RuntimeError) and \
        str(error).startswith('CUDA error')


def return_freed_memory() -> None:
    """
    Return the memory glibc's heap keeps after frees to the OS (malloc_trim; a no-op without glibc).

    After the weights moved into FlatTensors, the bundled target's old storages (34 MB) otherwise stayed resident;
    so did a closed backend's heap.
    """
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


HEAP_ARENAS = 2  # glibc malloc arenas of the node process (bound_heap_arenas); MALLOC_ARENA_MAX in the environment wins
M_ARENA_MAX = -8  # glibc's mallopt parameter number (malloc.h)


def bound_heap_arenas(arenas: int = HEAP_ARENAS) -> bool:
    """
    Cap glibc's malloc arenas of this process before it starts its threads; True when set (the node does at start).

    glibc gives each thread that allocates an arena of its own, up to 8 per core, and each arena keeps resident what
    its thread freed. The node's threads (the executor's pool, which grows to its peak concurrency, the goal workers,
    the batch scheduler) each kept their goals' freed memory, so a soak's RSS crept up as rarer peaks came by on
    other threads; two arenas bound that (the soak row of bench faults). Nothing where the C library is not glibc,
    or where MALLOC_ARENA_MAX is set (glibc read it at start).
    """
    if 'MALLOC_ARENA_MAX' in os.environ:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return mallopt(M_ARENA_MAX, arenas) == 1


def release_memory() -> None:
    """Give the memory of a closed, dropped backend back to the system: garbage, CUDA's cache, the C heap."""
    gc.collect()
    torch = sys.modules.get('torch')
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()
    return_freed_memory()

"""
Step tables: a step function per variant, run in the chosen compile mode and created on first use (_Steps).

A variant is a query length (or range), the logits kept and, for CUDA graphs, a key-length bucket. Also here: the
compile modes and the CUDA graph of one variant (_Graph).

How each mode builds its graphs is described in runner.py. On CPU with inductor a variant compiles through its own
backend (direct_graph._DirectGraph) where torch's internals allow (torch_internals.direct_graphs), else with public
torch.compile through dynamo.
"""

import inspect
import threading
import types
from collections import Counter
from collections.abc import Callable
from contextlib import nullcontext

import torch

from ..model.layers import ROW_PRODUCT_MAX_ROWS
from ..ops import cpu_ops, torch_internals
from ..ops.compile_cache import compile_cache_dir, release_compile_garbage
from .direct_graph import _DirectGraph, _DirectRecord

STEP_MODES = ('eager', 'inductor', 'inductor-gemm', 'cudagraph')
INDUCTOR_MODES = ('inductor', 'inductor-gemm')
CPU_AUTO_MODE = 'inductor'
# inductor settings of a graph compiled on frozen weights (inductor-gemm): its GEMM template needs constant weights
FROZEN_GEMM_SETTINGS = {'freezing': True, 'max_autotune': True, 'max_autotune_gemm_backends': 'CPP'}
MIN_BUCKET = 256          # smallest full-attention key length a CUDA graph is captured for


def query_variant(q: int, row_product_max_rows: int = ROW_PRODUCT_MAX_ROWS) -> int:
    """
    Return the CPU step variant (inductor) that serves q tokens, named by its shortest query.

    Each q up to row_product_max_rows has a graph of its own with the query length static, so that inductor fuses
    the rows of a product into one loop over the weight (layers._linear). Longer passes, whose products are aten's,
    share one graph with the query length dynamic.
    """
    return min(q, row_product_max_rows + 1)


def query_variant_ends(max_query: int, row_product_max_rows: int = ROW_PRODUCT_MAX_ROWS) -> list[tuple[int, ...]]:
    """
    Return the query lengths that build each CPU step variant of steps of 1..max_query tokens.

    Each variant is built at its shortest and its longest query: a graph from inductor's cache may serve fewer
    queries than a compiled one.
    """
    members: dict[int, list[int]] = {}
    for q in range(1, max_query + 1):
        members.setdefault(query_variant(q, row_product_max_rows), []).append(q)
    return [tuple(sorted({queries[0], queries[-1]})) for queries in members.values()]


def stores_blocked(mode: str, max_query: int, row_product_max_rows: int = ROW_PRODUCT_MAX_ROWS) -> bool:
    """
    Whether a target or draft model stores its layers' matrices blocked (weights.block_matrix; only packed weights are).

    Where every step's products are multiply-reduces: inductor's mode with steps of at most row_product_max_rows
    tokens. Elsewhere aten's products would run block by block (eager, longer passes), slower than on [out, in].
    """
    return mode == 'inductor' and max_query <= row_product_max_rows


def resolve_compile_mode(mode: str, device: torch.device) -> str:
    """auto|eager|inductor|cudagraph -> the mode used on this device (ValueError for an unknown or impossible one)."""
    if mode not in ('auto', *STEP_MODES):
        raise ValueError('engine.compile for the fast path must be auto or one of {}, got {!r}'.format(
            ', '.join(STEP_MODES), mode))
    if mode == 'auto':
        return 'cudagraph' if device.type == 'cuda' else CPU_AUTO_MODE
    if mode == 'cudagraph' and device.type != 'cuda':
        raise ValueError('engine.compile=cudagraph needs a CUDA device, the model is on {}'.format(device))
    if mode == 'inductor-gemm' and device.type != 'cpu':
        raise ValueError('engine.compile=inductor-gemm is for CPU (its GEMM template is C++), the model is on {}; '
                         'use cudagraph or inductor'.format(device))
    return mode


def _fresh(function):
    """Copy function with its own code object: torch.compile then keeps one cache (and guard set) per step."""
    return types.FunctionType(function.__code__.replace(), function.__globals__, function.__name__,
                              function.__defaults__, function.__closure__)


def _buckets(context_limit: int) -> list[int]:
    """Full-attention key lengths CUDA graphs are captured for: powers of two from MIN_BUCKET, then the limit."""
    sizes, size = [], min(MIN_BUCKET, context_limit)
    while size < context_limit:
        sizes.append(size)
        size *= 2
    return sizes + [context_limit]


class _Graph:
    """One captured CUDA graph over static input buffers; returns clones of its outputs."""

    def __init__(self, function, inputs: tuple[torch.Tensor, ...], pool):
        self.inputs = tuple(tensor.clone() for tensor in inputs)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up (allocations, lazy inits) outside the capture; writes are idempotent
            for _ in range(2):
                function(*self.inputs)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.outputs = function(*self.inputs)

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        for static, value in zip(self.inputs, inputs, strict=True):
            static.copy_(value, non_blocking=True)
        self.graph.replay()
        return tuple(output.clone() for output in self.outputs)


class _Steps:
    """
    Runs a step function per variant in the chosen mode, creating (compiling, capturing) each on first use.

    On CPU with inductor the variants are queries (query_variant: a static q each up to the lean model's
    row_product_max_rows, then one dynamic range; the key length dynamic); with inductor-gemm the range of 2 tokens
    or more compiles on frozen weights. Otherwise a variant is one q and, unless eager, one full-attention
    key-length bucket.

    With serve_eager (a background warm-up), a variant without a graph runs its step function eager instead of
    compiling in the caller's thread; graphs built elsewhere are staged (stage) and taken over between rounds
    (adopt), so that a round runs on one set of steps.
    """

    def __init__(self, mode: str, device: torch.device, context_limit: int, cpp_wrapper: bool,
                 row_product_max_rows: int = ROW_PRODUCT_MAX_ROWS):
        """
        Set up for one step function family (variants are created on first use).

        cpp_wrapper: C++ wrappers for CPU graphs (for models whose layers are inlined: inlines_layers).
        row_product_max_rows: the lean model's (it sets the CPU query variants).
        """
        self.mode = mode
        self.context_limit = context_limit
        if mode in INDUCTOR_MODES:
            compile_cache_dir()
        self.dynamic = mode in INDUCTOR_MODES and device.type == 'cpu'
        self.row_product_max_rows = row_product_max_rows
        self._options = {'cpp_wrapper': cpp_wrapper}
        self._variants: dict[tuple, Callable] = {}
        self._direct: dict[tuple, _DirectGraph] = {}  # the dynamic CPU variants' graphs
        self._pool = torch.cuda.graph_pool_handle() if mode == 'cudagraph' else None
        self.serve_eager = False                     # a variant without a graph runs eager (background warm-up)
        self.use_graphs = True                       # False: every step runs eager, graphs or not
        self._eager: dict[tuple, Callable] = {}      # step functions run uncompiled, per key
        self.demand: Counter = Counter()             # variant -> steps run eager for want of its graph
        self.graph_calls = 0                         # steps run compiled or captured
        self.eager_calls = 0                         # steps run eager (mode eager, or waiting for a graph)
        self._staged: list[tuple[int, dict[tuple, list[_DirectRecord]]]] = []  # (threads, graphs) to adopt
        self._staged_lock = threading.Lock()

    @property
    def count(self) -> int:
        return len(self._variants)

    @property
    def direct_count(self) -> int:
        """Variants with a graph called without dynamo at the current thread count."""
        return sum(direct.records > 0 for direct in self._direct.values())

    def forget_direct_graphs(self) -> None:
        """Drop the graphs recorded for direct calls (every call then enters through dynamo)."""
        self._direct.clear()

    def key_lengths(self) -> list[int]:
        """List the full-attention key lengths that get their own variant ([0]: one for all)."""
        return [0] if self.mode == 'eager' or self.dynamic else _buckets(self.context_limit)

    def key_length(self, needed: int) -> int:
        """Full-attention key length for a pass whose last position is needed - 1."""
        if self.mode == 'eager' or self.dynamic:
            return max(needed, 2)  # 2: keeps the dynamic dimension off torch's 0/1 specialisation
        return next(size for size in _buckets(self.context_limit) if size >= needed)

    def run(self, key: tuple, make: Callable[[], Callable], inputs: tuple[torch.Tensor, ...],
            kv_positions: torch.Tensor, dynamic_dims: tuple[int | None, ...]) -> tuple[torch.Tensor, ...]:
        """
        Run the variant for key (created by make() on first use) on inputs + kv_positions.

        dynamic_dims: per input, its query-length dimension (None: none), made dynamic on CPU for q past the
        row products (query_variant).
        """
        if self.mode in INDUCTOR_MODES:  # compiled graphs guard on strides and inference-mode tensors: normalise both
            inputs = tuple(tensor if tensor.is_contiguous() and tensor.is_inference() else
                           tensor.clone(memory_format=torch.contiguous_format) for tensor in inputs)
        arguments = (*inputs, kv_positions)
        q = next((inputs[index].shape[dim] for index, dim in enumerate(dynamic_dims) if dim is not None), 1)
        variant_key = self.variant_key(key, q, kv_positions.shape[0])
        direct = self._direct.get(variant_key) if self.use_graphs else None
        outputs = None if direct is None else direct.try_call(arguments)
        if outputs is not None:
            self.graph_calls += 1
            return outputs
        if self.mode == 'eager' or self.serve_eager or not self.use_graphs:
            self.eager_calls += 1
            self.demand[variant_key] += self.serve_eager and self.use_graphs
            function = self._eager.get(key)
            if function is None:
                function = self._eager[key] = make()
            return function(*arguments)
        self.graph_calls += 1
        if self.dynamic:  # a call through dynamo: a compile or recompile (after a thread-count change) stays dynamic
            torch_internals.mark_dynamic(kv_positions, 0)
            for tensor, dim in zip(inputs, dynamic_dims, strict=True):
                if dim is not None and q > self.row_product_max_rows:
                    torch_internals.mark_dynamic(tensor, dim)
        variant = self._variants.get(variant_key)
        if variant is None:
            variant = self._create(variant_key, make(), arguments, q)
            self._variants[variant_key] = variant
            # compiles: every guard is built and checked
            with torch.compiler.set_stance('default'), self._compile_settings(q):
                outputs = variant(*arguments)
            if self.mode in INDUCTOR_MODES:
                release_compile_garbage()
        elif self.dynamic:
            outputs = self._run_guarded(variant, arguments, q)
        else:
            return variant(*arguments)
        if variant_key in self._direct:  # after a compile, or a call no recorded graph accepted
            self._direct[variant_key].confirm(arguments, outputs)
        return outputs

    def _run_guarded(self, variant: Callable, arguments: tuple[torch.Tensor, ...], q: int) -> tuple[torch.Tensor, ...]:
        """
        Run a dynamic CPU variant through dynamo, skipping its guards unless the step must recompile.

        Each variant is its own code object, called only from run() with inputs made the same way, so no guard can
        tell its entries apart; skipping their evaluation saves ~0.5 ms a call.
        """
        try:
            with torch.compiler.set_stance('default', skip_guard_eval_unsafe=True):
                return variant(*arguments)
        except RuntimeError as exc:  # raised before the graph runs when it must recompile (threads changed)
            if 'skip_guard_eval_unsafe' not in str(exc):
                raise
        # guards evaluated and the step recompiled
        with torch.compiler.set_stance('default'), self._compile_settings(q):
            return variant(*arguments)

    def _compile_settings(self, q: int):
        """Inductor's settings for compiling the variant of q tokens: frozen weights for q >= 2 in inductor-gemm."""
        if self.mode == 'inductor-gemm' and q >= 2:
            return torch_internals.frozen_weight_settings(FROZEN_GEMM_SETTINGS)
        return nullcontext()

    def variant_key(self, key: tuple, q: int, kv_len: int) -> tuple:
        """Return the variant that serves a step of q tokens over kv_len full-attention keys."""
        if self.mode == 'eager':
            return key
        if self.dynamic:
            return (*key, query_variant(q, self.row_product_max_rows))
        return (*key, q, kv_len)

    def take_confirmed(self) -> dict[tuple, list[_DirectRecord]]:
        """Remove and return the graphs confirmed for direct calls at this thread count, per variant."""
        taken = {key: direct.take_records() for key, direct in self._direct.items()}
        return {key: records for key, records in taken.items() if records}

    def stage(self, graphs: dict[tuple, list[_DirectRecord]]) -> None:
        """Hand over graphs for adopt() (from any thread); they serve at this thread count."""
        with self._staged_lock:
            self._staged.append((torch.get_num_threads(), graphs))

    def adopt(self) -> None:
        """Take over the staged graphs (between rounds, in the serving thread)."""
        if not self._staged:
            return
        with self._staged_lock:
            staged, self._staged = self._staged, []
        for threads, graphs in staged:
            for variant_key, records in graphs.items():
                if variant_key not in self._direct:
                    self._direct[variant_key] = _DirectGraph((), self._options)
                self._direct[variant_key].add_records(threads, records)

    def _create(self, variant_key: tuple, function: Callable, inputs: tuple[torch.Tensor, ...], q: int) -> Callable:
        if self.mode == 'cudagraph':
            return _Graph(function, inputs, self._pool)
        if self.dynamic:  # with cpp_wrapper no Python runs between the graph's kernels (model.py: INLINE_MAX_LAYERS)
            # before the first trace (not at load: eager steps serve meanwhile): layers._attend calls it once built
            cpu_ops.ensure_built()
            if not torch_internals.direct_graphs():  # torch's public path: every call through dynamo
                frozen = FROZEN_GEMM_SETTINGS if self.mode == 'inductor-gemm' and q >= 2 else None
                return torch.compile(_fresh(function), fullgraph=True, dynamic=torch_internals.compile_dynamic(),
                                     options=torch_internals.compile_options(self._options, frozen))
            direct = self._direct[variant_key] = _DirectGraph(tuple(inspect.signature(function).parameters),
                                                              self._options)
            return torch.compile(_fresh(function), fullgraph=True, dynamic=torch_internals.compile_dynamic(),
                                 backend=direct)
        compiled = torch.compile(_fresh(function), fullgraph=True, dynamic=False, mode='reduce-overhead')

        def run_captured(*inputs):  # outputs of inductor's CUDA graphs are overwritten by the next replay: copy
            torch.compiler.cudagraph_mark_step_begin()
            return tuple(output.clone() for output in compiled(*inputs))
        return run_captured


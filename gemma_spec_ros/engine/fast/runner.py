"""
Step functions per query length over the lean forward and the static cache: eager, inductor-compiled or captured.

- ``eager``: the lean forward runs eager on the static cache.
- ``inductor``: torch.compile graphs. On CPU one per step function and query variant (query_variant: each q whose
  products are multiply-reduces, with the query length static; then one for longer passes, whose products are
  aten's, with the query length dynamic), with the full-attention key length dynamic, so they serve every
  position; for models of up to model.INLINE_MAX_LAYERS layers their wrappers are C++ (cpp_wrapper); once
  compiled, a CPU graph is called without dynamo's entry (_DirectGraph). On CUDA one per (q, key-length bucket),
  captured as CUDA graphs by inductor (mode reduce-overhead).
- ``inductor-gemm`` (CPU only): inductor, with the target's and draft model's passes of 2 tokens or more compiled on
  frozen weights, so that their products run inductor's C++ GEMM template (register-blocked, on weights packed at
  compile time) instead of multiply-reduces or aten's product. Verify passes of 3-9 tokens took 17-24 % less time
  (bench/RESULTS.md); the price is one more copy of those models' weights, and a compile at every start that no
  cache keeps (packed weights cannot be pickled): about a minute for the bundled target.
- ``cudagraph`` (CUDA only): the eager lean forward captured as a torch.cuda.CUDAGraph per (q, logits kept,
  key-length bucket), replayed on static input buffers.
- ``auto``: cudagraph on CUDA, CPU_AUTO_MODE on CPU (inductor: faster than eager on every step measured, README
  "Measured figures"). Warm-up of target + draft + assistant takes minutes with a cold inductor cache, ~25 s
  warm: torch's FX-graph and AOTAutograd caches persist across processes and reboots in TORCHINDUCTOR_CACHE_DIR
  (compile_cache_dir).

Warm up after every model is loaded and the thread count is set: compiled graphs guard on torch's thread count and
on the registered pytree types, and a change recompiles (slowly, but correctly).
"""

import copy
import functools
import gc
import inspect
import linecache
import os
import threading
import time
import types
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

from ..sampling import greedy_pick
from ..verify import verify
from .cache import StaticKvCache
from .model import ROW_PRODUCT_MAX_ROWS, LeanAssistant, LeanGemma4, StepOutput, return_freed_memory, store_exact_half

STEP_MODES = ('eager', 'inductor', 'inductor-gemm', 'cudagraph')
INDUCTOR_MODES = ('inductor', 'inductor-gemm')
CPU_AUTO_MODE = 'inductor'
# inductor settings of a graph compiled on frozen weights (inductor-gemm): its GEMM template needs constant weights
FROZEN_GEMM_SETTINGS = {'freezing': True, 'max_autotune': True, 'max_autotune_gemm_backends': 'CPP'}
MIN_BUCKET = 256          # smallest full-attention key length a CUDA graph is captured for
GREEDY_STEPS = (1, 2, 4, 8)  # MTP draft steps per call of a greedy round's step functions (FastAssistant.greedy_drafts)
Progress = Callable[[str], None]


def greedy_chunks(num_drafts: int) -> list[int]:
    """Return the steps per call of a greedy MTP round of num_drafts drafts: each the most GREEDY_STEPS that fit."""
    chunks = []
    while num_drafts:
        chunks.append(max(steps for steps in GREEDY_STEPS if steps <= num_drafts))
        num_drafts -= chunks[-1]
    return chunks


@functools.cache  # the adaptive controller prices every K at every decision
def greedy_calls(num_drafts: int) -> int:
    """Return the calls of a greedy MTP round of num_drafts drafts (K = 4 one, K = 5 two)."""
    return len(greedy_chunks(num_drafts))


def query_variant(q: int, row_product_max_rows: int = ROW_PRODUCT_MAX_ROWS) -> int:
    """
    Return the CPU step variant (inductor) that serves q tokens, named by its shortest query.

    Each q up to row_product_max_rows has a graph of its own with the query length static, so that inductor fuses
    the rows of a product into one loop over the weight (model._linear). Longer passes, whose products are aten's,
    share one graph with the query length dynamic.
    """
    return min(q, row_product_max_rows + 1)


def stores_blocked(mode: str, max_query: int, row_product_max_rows: int = ROW_PRODUCT_MAX_ROWS) -> bool:
    """
    Whether a target or draft model stores its layers' matrices blocked (model.block_matrix; only packed weights are).

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


def compile_cache_dir() -> str:
    """
    Return inductor's cache directory: TORCHINDUCTOR_CACHE_DIR, set first to one under ~/.cache unless the user chose.

    torch's default, /tmp/torchinductor_$USER, is emptied at boot on many systems, and a cold cache costs minutes of
    compiling at the next start. Importing torch._inductor.config writes that default into the variable, so the
    default counts as unset.
    """
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir as torch_default

    chosen = os.environ.get('TORCHINDUCTOR_CACHE_DIR')
    if chosen is None or os.path.abspath(chosen) == os.path.abspath(torch_default()):
        home = Path(os.environ.get('XDG_CACHE_HOME') or Path.home() / '.cache')
        os.environ['TORCHINDUCTOR_CACHE_DIR'] = str(home / 'gemma_spec_ros' / 'torchinductor')
    return os.environ['TORCHINDUCTOR_CACHE_DIR']


def _fresh(function):
    """Copy function with its own code object: torch.compile then keeps one cache (and guard set) per step."""
    return types.FunctionType(function.__code__.replace(), function.__globals__, function.__name__,
                              function.__defaults__, function.__closure__)


def _release_compile_garbage() -> None:
    """
    After a torch.compile: drop what torch keeps for uses the engine never makes, and collect the compile's cycles.

    torch.compiler keeps the bytes of every cache artifact it wrote or read (for torch.compiler.save_cache_artifacts,
    which the engine does not call), linecache the source files read for guard and node stack traces. Freed before
    the next graph compiles, the memory is reused by it: the serving peak after warm-up falls by ~10 MiB (5 graphs,
    bench/fast_measure.py memory; freed only at the end, the fragments stay resident). What the heap then keeps
    free goes back to the OS.
    """
    try:
        from torch.compiler._cache import CacheArtifactManager
    except ImportError:  # a torch without the mega-cache
        pass
    else:
        CacheArtifactManager.clear()
    linecache.clearcache()
    gc.collect()
    return_freed_memory()


def _release_traced_module(graph: Callable) -> None:
    """
    Let the GraphModule dynamo traced be freed once inductor compiled it.

    AOTAutograd hangs the traced module's zero_grad / named_parameters / named_buffers on the compiled function and
    its wrappers, for convenience only: they kept every traced graph alive (~1,400 nodes with source stack traces and
    fake tensors for the bundled target's). Without them the serving peak fell by 20 MiB (bench.fast_measure memory).
    """
    while graph is not None:
        for name in ('zero_grad', 'named_parameters', 'named_buffers'):
            getattr(graph, '__dict__', {}).pop(name, None)
        graph = getattr(graph, '__wrapped__', None)


def _buckets(context_limit: int) -> list[int]:
    """Full-attention key lengths CUDA graphs are captured for: powers of two from MIN_BUCKET, then the limit."""
    sizes, size = [], min(MIN_BUCKET, context_limit)
    while size < context_limit:
        sizes.append(size)
        size *= 2
    return sizes + [context_limit]


@dataclass
class WarmupReport:
    """What warm-up did."""

    mode: str
    graphs: int
    seconds: float
    direct_graphs: int = 0  # of those, variants with a graph called without dynamo's entry (_DirectGraph)


@dataclass(eq=False)  # a job is itself: the warm-up keeps sets of them
class GraphJob:
    """
    One step graph that a background warm-up builds (engine/warmup.py), while its model serves on eager steps.

    build() compiles the variant on a shadow of the model (the same weights, a scratch cache: the served cache is
    never touched) and stages the graph on the served steps, which adopt it between rounds (Warmup.adopt).
    """

    name: str                        # e.g. 'target q=1', 'mtp greedy x4'
    owner: object                    # the FastCausalLM or FastAssistant it serves (release_shadow when done)
    steps: '_Steps'                  # the served steps: demand for this graph is counted there
    variant_keys: tuple[tuple, ...]  # the variants the graph serves
    build: Callable[[], int]         # returns how many graphs it staged

    @property
    def demand(self) -> int:
        """Steps run eager so far for want of this graph."""
        return sum(self.steps.demand[key] for key in self.variant_keys)


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


@dataclass
class _DirectRecord:
    """One compiled graph of a step variant and how to call it."""

    graph: Callable
    bindings: list[tuple]              # per graph argument: ('input', i) | ('size', i, dim) | ('fixed', tensor)
    size_guards: types.CodeType | None  # dynamo's shape guards over the ('size') arguments, named L['t0'], L['t1'], ...
    guard_names: dict                   # what the guards' code may call (torch's SYMPY_INTERP)

    def __post_init__(self):
        self._sizes = [(binding[1], binding[2]) for binding in self.bindings if binding[0] == 'size']

    def rebound(self, tensors: dict[int, torch.Tensor]) -> '_DirectRecord':
        """Return this graph reading tensors[id(t)] wherever it read a fixed tensor t (a shadow's cache: the served)."""
        bindings = [('fixed', tensors.get(id(binding[1]), binding[1])) if binding[0] == 'fixed' else binding
                    for binding in self.bindings]
        return _DirectRecord(self.graph, bindings, self.size_guards, self.guard_names)

    def accepts(self, inputs: tuple[torch.Tensor, ...]) -> bool:
        if self.size_guards is None:
            return True
        sizes = {f't{i}': inputs[index].shape[dim] for i, (index, dim) in enumerate(self._sizes)}
        return bool(eval(self.size_guards, self.guard_names, {'L': sizes}))

    def __call__(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        arguments = [inputs[binding[1]] if binding[0] == 'input' else
                     inputs[binding[1]].shape[binding[2]] if binding[0] == 'size' else binding[1]
                     for binding in self.bindings]
        return tuple(self.graph(*arguments))  # as dynamo's bytecode calls a backend's graph


class _DirectGraph:
    """
    The torch.compile backend of one CPU step variant, which then calls inductor's graphs without dynamo's frame.

    Through torch.compile's entry a call costs ~0.1-0.2 ms more than the graph (dynamo's frame, its bytecode, the
    stance switch, mark_dynamic: README "Graphs called directly"). Compiling, this records inductor's callable, where
    each graph argument comes from (a step input, a size of one, or a tensor the step closes over: weights and cache
    buffers, which stay the same objects) and the shape guards dynamo would check on those sizes (a graph from
    inductor's cache can serve a narrower range than the variant's). Records are per torch thread count, as dynamo's
    guards are. A call no record accepts goes through dynamo, which compiles and records another. A record is used
    only once a direct call gave exactly what dynamo's call gave (confirm). Dynamo's other guards (grad mode, global
    torch settings, registered pytree types) are not checked: the runner's calls keep them as at the compile.
    """

    def __init__(self, argument_names: tuple[str, ...], options: dict):
        self.argument_names = argument_names
        self._options = options
        self._records: dict[int, list[_DirectRecord]] = {}  # thread count -> confirmed records
        self._pending: _DirectRecord | None = None  # compiled, not confirmed yet

    def __call__(self, graph_module: torch.fx.GraphModule, example_inputs: list) -> Callable:
        from torch._guards import TracingContext
        from torch._inductor.compile_fx import compile_fx
        from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP

        graph = compile_fx(graph_module, example_inputs, config_patches=self._options)
        placeholders = [node for node in graph_module.graph.nodes if node.op == 'placeholder']
        bindings = [self._binding(node, value) for node, value in zip(placeholders, example_inputs, strict=True)]
        sizes = [value for value in example_inputs if isinstance(value, torch.SymInt)]
        shape_env = TracingContext.get().fake_mode.shape_env
        guards = shape_env.produce_guards_expression(sizes, guards=shape_env.get_pruned_guards(sizes)) \
            if sizes else None  # after compile_fx: it adds the guards of a graph taken from inductor's cache
        self._pending = None if None in bindings else _DirectRecord(
            graph, bindings, compile(guards, '<size guards>', 'eval') if guards else None, SYMPY_INTERP)
        _release_traced_module(graph)
        return graph

    def _binding(self, node: torch.fx.Node, value) -> tuple | None:
        """('input', index) | ('size', index, dim) | ('fixed', value) for one graph argument; None: unknown."""
        from torch._dynamo.source import LocalSource, TensorProperty, TensorPropertySource

        def argument_index(source) -> int | None:
            is_argument = isinstance(source, LocalSource) and not source.is_derefed_cell_contents and \
                source.local_name in self.argument_names
            return self.argument_names.index(source.local_name) if is_argument else None

        source = getattr(node.meta.get('grapharg'), 'source', None)
        index = argument_index(source)
        if index is not None:
            return ('input', index)
        if isinstance(source, TensorPropertySource):
            index = argument_index(source.base)
            if source.prop is not TensorProperty.SIZE or index is None:
                return None
            return ('size', index, source.idx)
        if source is None or not isinstance(value, torch.Tensor):
            return None
        return ('fixed', value)  # a global or closed-over tensor: the same object at every call

    @property
    def records(self) -> int:
        """Confirmed graphs at this thread count."""
        return len(self._records.get(torch.get_num_threads(), ()))

    def take_records(self) -> list['_DirectRecord']:
        """Remove and return the graphs confirmed at this thread count."""
        return self._records.pop(torch.get_num_threads(), [])

    def add_records(self, threads: int, records: list['_DirectRecord']) -> None:
        """Serve direct calls at that thread count with these graphs too."""
        self._records.setdefault(threads, []).extend(records)

    def try_call(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...] | None:
        """Run the first graph recorded for this thread count that accepts the inputs; None when none does."""
        for record in self._records.get(torch.get_num_threads(), ()):
            if record.accepts(inputs):
                return record(inputs)
        return None

    def confirm(self, inputs: tuple[torch.Tensor, ...], outputs: tuple[torch.Tensor, ...]) -> None:
        """
        After dynamo's call on inputs, call the graph it compiled for them (if any) directly on the same inputs.

        A step is idempotent (it rewrites the same cache slots), so a second run is harmless. The graph serves
        direct calls only if it returned exactly dynamo's outputs.
        """
        record, self._pending = self._pending, None
        if record is None or not record.accepts(inputs):
            return
        direct = record(inputs)
        if len(direct) == len(outputs) and all(
                torch.equal(mine, theirs) for mine, theirs in zip(direct, outputs, strict=True)):
            self._records.setdefault(torch.get_num_threads(), []).append(record)


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
            torch._dynamo.mark_dynamic(kv_positions, 0)
            for tensor, dim in zip(inputs, dynamic_dims, strict=True):
                if dim is not None and q > self.row_product_max_rows:
                    torch._dynamo.mark_dynamic(tensor, dim)
        variant = self._variants.get(variant_key)
        if variant is None:
            variant = self._create(variant_key, make(), arguments)
            self._variants[variant_key] = variant
            # compiles: every guard is built and checked
            with torch.compiler.set_stance('default'), self._compile_settings(q):
                outputs = variant(*arguments)
            if self.mode in INDUCTOR_MODES:
                _release_compile_garbage()
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
            return torch._inductor.config.patch(FROZEN_GEMM_SETTINGS)
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

    def _create(self, variant_key: tuple, function: Callable, inputs: tuple[torch.Tensor, ...]) -> Callable:
        if self.mode == 'cudagraph':
            return _Graph(function, inputs, self._pool)
        if self.dynamic:  # with cpp_wrapper no Python runs between the graph's kernels (model.py: INLINE_MAX_LAYERS)
            direct = self._direct[variant_key] = _DirectGraph(tuple(inspect.signature(function).parameters),
                                                              self._options)
            return torch.compile(_fresh(function), fullgraph=True, dynamic=False, backend=direct)
        compiled = torch.compile(_fresh(function), fullgraph=True, dynamic=False, mode='reduce-overhead')

        def run_captured(*inputs):  # outputs of inductor's CUDA graphs are overwritten by the next replay: copy
            torch.compiler.cudagraph_mark_step_begin()
            return tuple(output.clone() for output in compiled(*inputs))
        return run_captured


def _stage_shadow_graphs(served: _Steps, shadow: _Steps, served_cache: StaticKvCache,
                         shadow_cache: StaticKvCache) -> int:
    """Stage on the served steps the graphs a shadow confirmed, reading the served cache; returns how many."""
    tensors = {id(mine): theirs for mine, theirs in zip(shadow_cache.tensors(), served_cache.tensors(), strict=True)}
    graphs = {key: [record.rebound(tensors) for record in records]
              for key, records in shadow.take_confirmed().items()}
    if graphs:
        served.stage(graphs)
    return sum(len(records) for records in graphs.values())


class _Shadowed:
    """
    A runner that a background warm-up compiles on a shadow of (GraphJob.build), made on first use.

    The shadow shares the weights and has a cache and steps of its own: compiling runs a step, which must not touch
    the cache that serves.
    """

    _shadow = None
    _steps: _Steps

    def _new_steps(self) -> _Steps:
        raise NotImplementedError

    def _give_shadow_a_cache(self, shadow) -> None:
        raise NotImplementedError

    def shadow(self):
        """Return the shadow (made now if there is none)."""
        if self._shadow is None:
            shadow = copy.copy(self)
            self._give_shadow_a_cache(shadow)
            shadow._steps = shadow._new_steps()
            shadow._shadow = None
            self._shadow = shadow
        return self._shadow

    def release_shadow(self) -> None:
        """Free the shadow's cache and compiled wrappers (its graphs now serve this runner)."""
        self._shadow = None
        _release_compile_garbage()


class FastCausalLM(_Shadowed):
    """
    A Gemma 4 causal LM (target or draft model) on a static cache with per-q step functions.

    Construct after the model is on its device and dtype. ``context_limit`` sizes the cache (prompt + generated),
    ``max_query`` is the longest step (K_max + 1). Not thread-safe: one request at a time.
    """

    def __init__(self, model, context_limit: int, max_query: int, compile_mode: str = 'auto'):
        self.model = model
        self.mode = resolve_compile_mode(compile_mode, model.device)
        # inductor-gemm: passes of 2 tokens or more keep aten's products, which the GEMM template generates
        self.lean = LeanGemma4(model, 1 if self.mode == 'inductor-gemm' else ROW_PRODUCT_MAX_ROWS,
                               blocked=stores_blocked(self.mode, max_query))
        if self.mode == 'inductor-gemm':  # weights that freezing may treat as constants
            for weights in self.lean.tensors.buffers:
                torch._dynamo.mark_static_address(weights)
        self.cache: StaticKvCache = self.lean.new_cache(context_limit, max_query)
        self.max_query = max_query
        self._steps = self._new_steps()

    def _new_steps(self) -> _Steps:
        return _Steps(self.mode, self.lean.device, self.cache.context_limit, self.lean.inlines_layers,
                      self.lean.row_product_max_rows)

    @property
    def length(self) -> int:
        """Tokens in the cache."""
        return self.cache.length

    @property
    def nbytes(self) -> int:
        """Bytes this adds to the model's weights: the KV cache."""
        return self.cache.nbytes

    def reset(self) -> None:
        """Start a new request (the cache forgets every token)."""
        self.cache.reset()

    def crop(self, tokens_to_remove: int) -> None:
        """Roll back: drop the last -tokens_to_remove tokens (DynamicCache.crop convention; nothing is copied)."""
        self.cache.crop(tokens_to_remove)

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor, logits_to_keep: int = 1, want_states: bool = False) -> StepOutput:
        """
        Append input_ids [1, n] (any n) eager; logits and hidden of the last logits_to_keep (0: all).

        The hidden states come free, whatever want_states says (it is there for causal_lm.DynamicCausalLM's
        interface).
        """
        return self.lean.prefill(input_ids, self.cache, self.cache.length, logits_to_keep)

    def append(self, input_ids: torch.Tensor, logits_to_keep: int = 0, want_states: bool = False) -> StepOutput:
        """Append input_ids [1, n]: through the step for n when n <= max_query, else through prefill."""
        if input_ids.shape[1] <= self.max_query:
            return self.step(input_ids, logits_to_keep)
        return self.prefill(input_ids, logits_to_keep)

    @torch.inference_mode()
    def step(self, input_ids: torch.Tensor, logits_to_keep: int = 0) -> StepOutput:
        """
        Append input_ids [1, q] (q <= max_query) at the cache end through the step for q.

        logits_to_keep 0 keeps all q (the verify pass, which also returns greedy_row), 1 only the last (draft model).
        With cudagraph the outputs are copies, with inductor on CUDA they live until the next call of the same step.
        """
        q = input_ids.shape[1]
        if not 1 <= q <= self.max_query:
            raise ValueError('a step takes 1..{} tokens (max_query), got {}'.format(self.max_query, q))
        start = self.cache.length
        self.cache.check_write(start, q)
        positions = torch.arange(start, start + q, device=self.lean.device)
        kv_positions = self.cache.key_positions[:self._steps.key_length(start + q)]
        key = self._step_key(q, logits_to_keep)
        logits, hidden, *greedy_row = self._steps.run(key, lambda: self._step_function(*key),
                                                      (input_ids, positions), kv_positions, dynamic_dims=(1, 0))
        self.cache.advance(start, q)
        return StepOutput(logits, hidden, greedy_row=greedy_row[0] if greedy_row else None)

    @staticmethod
    def _step_key(q: int, logits_to_keep: int) -> tuple[int, bool]:
        """(logits kept, 0: all; whether the step verifies) of a step of q tokens."""
        keep = 0 if logits_to_keep in (0, q) else logits_to_keep
        return keep, logits_to_keep == 0  # not a draft model's one-token step, which also keeps all (one) logits

    def _step_function(self, keep: int, verifying: bool):
        lean, cache = self.lean, self.cache

        def step(input_ids, positions, kv_positions):
            out = lean.step(input_ids, positions, cache, kv_positions.shape[0], keep)
            if not verifying:
                return out.logits, out.hidden
            # a verify pass: greedy verification inside the graph saves the round ~10 eager ops (README). Its drafts
            # get one more that is never accepted (-1) and the logits one more row: the same verdict, without a
            # (q - 1)-long tensor, which would make torch.compile specialise q = 2
            drafts = torch.cat([input_ids, torch.full_like(input_ids[:, :1], -1)], dim=1)[:, 1:]   # [1, q]
            logits = torch.cat([out.logits, out.logits[:, -1:]], dim=1)                          # [1, q + 1, vocab]
            num_accepted, next_token = verify(drafts, logits, None, greedy=True)
            return out.logits, out.hidden, torch.cat([num_accepted, drafts[0], next_token])
        return step

    @torch.inference_mode()
    def warmup(self, logits_to_keep: int = 0, progress: Progress | None = None) -> WarmupReport:
        """
        Create the step variants for q = 1..max_query before the first request; the cache is reset after.

        logits_to_keep as the steps will use it (0: all, the target's verify pass; 1: a draft model). Returns the
        mode, the number of variants created and the seconds it took.
        """
        say = progress or (lambda message: None)
        started = time.perf_counter()
        queries = range(1, self.max_query + 1)
        if self._steps.dynamic:  # each variant at both ends: a graph from inductor's cache may serve fewer queries
            ranges: dict[int, list[int]] = {}
            for q in queries:
                ranges.setdefault(query_variant(q, self.lean.row_product_max_rows), []).append(q)
            queries = sorted({end for members in ranges.values() for end in (members[0], members[-1])})
        for q in queries:
            for length in self._steps.key_lengths():
                self.cache.reset()
                self.cache.advance(0, max(0, length - q - 1))  # the step's last position needs this key length
                self.step(torch.zeros((1, q), dtype=torch.long, device=self.lean.device), logits_to_keep)
            say('warm-up: q={} done ({} mode, {:.1f} s)'.format(q, self.mode, time.perf_counter() - started))
        self.cache.reset()
        return WarmupReport(self.mode, self._steps.count, time.perf_counter() - started, self._steps.direct_count)

    def graph_jobs(self, role: str, logits_to_keep: int = 0) -> list[GraphJob]:
        """
        List the step graphs a background warm-up builds, a job per CPU query variant (none unless compiled on CPU).

        Each compiles at both ends of its query range, as warmup() does; logits_to_keep as the steps will use it.
        """
        if not self._steps.dynamic:
            return []
        ranges: dict[int, list[int]] = {}
        for q in range(1, self.max_query + 1):
            ranges.setdefault(query_variant(q, self.lean.row_product_max_rows), []).append(q)
        jobs = []
        for members in ranges.values():
            ends = tuple(sorted({members[0], members[-1]}))
            name = '{} q={}'.format(role, '..'.join(str(q) for q in ends))
            keys = tuple(self._steps.variant_key(self._step_key(q, logits_to_keep), q, 0) for q in ends)
            jobs.append(GraphJob(name, self, self._steps, keys,
                                 functools.partial(self._build_on_shadow, ends, logits_to_keep)))
        return jobs

    @torch.inference_mode()
    def _build_on_shadow(self, queries: tuple[int, ...], logits_to_keep: int) -> int:
        shadow = self.shadow()
        for q in queries:
            shadow.cache.reset()
            shadow.step(torch.zeros((1, q), dtype=torch.long, device=self.lean.device), logits_to_keep)
        shadow.cache.reset()
        return _stage_shadow_graphs(self._steps, shadow._steps, self.cache, shadow.cache)

    def _give_shadow_a_cache(self, shadow: 'FastCausalLM') -> None:
        shadow.cache = self.lean.new_cache(self.cache.context_limit, self.max_query)


class FastAssistant(_Shadowed):
    """
    The MTP assistant as one step function reading a FastCausalLM target's static cache.

    With inductor on CPU its matrices are stored in 16 bits where that is exact (``weights_dtype``; see
    model.store_exact_half): its own forward is then off. Its steps are all one token, which that suits; a draft
    model's catch-up steps of two tokens ran slower so (bench figures in bench/RESULTS.md).
    """

    def __init__(self, assistant, target: FastCausalLM, compile_mode: str = 'auto'):
        self.target = target
        self.mode = resolve_compile_mode(compile_mode, target.lean.device)
        compiled_for_cpu = self.mode in INDUCTOR_MODES and target.lean.device.type == 'cpu'
        self.weights_dtype = store_exact_half(assistant) if compiled_for_cpu else None
        self.lean = LeanAssistant(assistant, target.lean)  # after the dtype change: it packs the weights as they are
        self._steps = self._new_steps()

    def _new_steps(self) -> _Steps:
        return _Steps(self.mode, self.target.lean.device, self.target.cache.context_limit, self.lean.inlines_layers)

    def step(self, token_ids: torch.Tensor, hidden: torch.Tensor, position: int) -> StepOutput:
        """
        One draft step at position (= the target cache length): token_ids [1, 1], hidden [1, 1, backbone].

        Returns logits [1, 1, vocab] and the hidden [1, 1, backbone] for the next step.
        """
        with self.drafting(position) as step:
            return step(token_ids, hidden)

    @contextmanager
    def drafting(self, position: int) -> Iterator[Callable[[torch.Tensor, torch.Tensor], StepOutput]]:
        """Yield the step function of one draft round at position: step(token_ids, hidden) as in step()."""
        with self._round(position) as (positions, kv_positions):
            def step(token_ids: torch.Tensor, hidden: torch.Tensor) -> StepOutput:
                logits, projected = self._steps.run((1,), self._step_function, (token_ids, hidden, positions),
                                                    kv_positions, dynamic_dims=(None, None, None))
                return StepOutput(logits, projected)
            yield step

    def greedy_drafts(self, token_ids: torch.Tensor, hidden: torch.Tensor, position: int, k: int,
                      min_confidence: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        """
        Draft k greedy tokens at position from token_ids [1, 1] and hidden [1, 1, backbone] (as step() and argmax).

        Returns the tokens [k] and the assistant's probability of each [k]. Runs GREEDY_STEPS steps per call where
        it can: each step function unrolls its steps with their argmax, so a round of K = 4 pays one call's
        overhead instead of four (and no Python between the steps). With a cut-off (min_confidence > 0) the round
        ends at its first draft under it, that draft included, as DraftRound's does: the calls after that draft's
        are not run (the drafts after it in the same call are computed and dropped).
        """
        tokens, confidences = [], []
        with self._round(position) as (positions, kv_positions):
            for size in greedy_chunks(k):
                chunk_tokens, chunk_confidences, hidden = self._steps.run(
                    ('greedy', size), lambda size=size: self._greedy_function(size), (token_ids, hidden, positions),
                    kv_positions, dynamic_dims=(None, None, None))
                tokens.append(chunk_tokens)
                confidences.append(chunk_confidences)
                token_ids = chunk_tokens[-1:].view(1, 1)
                if min_confidence:
                    low = (chunk_confidences < min_confidence).nonzero()  # one host sync per call
                    if low.numel():
                        keep = low[0, 0].item() + 1
                        tokens[-1], confidences[-1] = chunk_tokens[:keep], chunk_confidences[:keep]
                        break
        return torch.cat(tokens), torch.cat(confidences)

    @contextmanager
    def _round(self, position: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """
        Yield (positions [1], kv_positions) of a draft round at position.

        Every step of a round drafts at the same position: its tensors are set up once per round instead of once per
        step.
        """
        cache = self.target.cache
        if not 0 < position <= cache.length:
            raise ValueError('the assistant drafts at a position in 1..{} (the target cache length), got {}'.format(
                cache.length, position))
        with torch.inference_mode():
            yield (torch.tensor([position], device=self.target.lean.device),
                   cache.key_positions[:self._steps.key_length(position)])

    def _step_function(self):
        lean, cache = self.lean, self.target.cache

        def step(token_ids, hidden, positions, kv_positions):
            out = lean.step(token_ids, hidden, positions, cache, kv_positions.shape[0])
            return out.logits, out.hidden
        return step

    def _greedy_function(self, num_steps: int):
        lean, cache = self.lean, self.target.cache

        def steps(token_ids, hidden, positions, kv_positions):
            tokens, confidences = [], []
            for _ in range(num_steps):
                out = lean.step(token_ids, hidden, positions, cache, kv_positions.shape[0])
                token, confidence = greedy_pick(out.logits[0, -1])  # as DraftRound.draw's greedy draft
                tokens.append(token)
                confidences.append(confidence)
                token_ids, hidden = token.view(1, 1), out.hidden
            return torch.stack(tokens), torch.stack(confidences), hidden
        return steps

    @torch.inference_mode()
    def warmup(self, progress: Progress | None = None) -> WarmupReport:
        """Create the step variants (every key-length bucket on CUDA); the target cache is reset after."""
        say = progress or (lambda message: None)
        started = time.perf_counter()
        cache, device = self.target.cache, self.target.lean.device
        for length in self._steps.key_lengths():
            cache.reset()
            cache.advance(0, max(length, 2))
            token_ids = torch.zeros((1, 1), dtype=torch.long, device=device)
            hidden = torch.zeros((1, 1, self.target.lean.hidden_size), dtype=self.target.lean.dtype, device=device)
            self.step(token_ids, hidden, cache.length)
            for size in GREEDY_STEPS:
                self.greedy_drafts(token_ids, hidden, cache.length, size)
        cache.reset()
        say('warm-up: MTP assistant ({} mode, {:.1f} s)'.format(self.mode, time.perf_counter() - started))
        return WarmupReport(self.mode, self._steps.count, time.perf_counter() - started, self._steps.direct_count)

    def graph_jobs(self, role: str) -> list[GraphJob]:
        """
        List the step graphs a background warm-up builds (none unless steps compile on CPU).

        Greedy rounds first, in the order adaptive K reaches them (K = 4 is one call of 4 steps, K = 5 adds one of 1),
        then the single step that sampled rounds use.
        """
        if not self._steps.dynamic:
            return []
        sizes = sorted(GREEDY_STEPS, key=lambda size: (size != 4, size))
        jobs = [GraphJob('{} greedy x{}'.format(role, size), self, self._steps,
                         (self._steps.variant_key(('greedy', size), 1, 0),),
                         functools.partial(self._build_on_shadow, size)) for size in sizes]
        jobs.append(GraphJob('{} step'.format(role), self, self._steps, (self._steps.variant_key((1,), 1, 0),),
                             functools.partial(self._build_on_shadow, 0)))
        return jobs

    @torch.inference_mode()
    def _build_on_shadow(self, greedy_steps: int) -> int:
        """Compile the greedy call of greedy_steps steps (0: the single step) on the shadow; stage it here."""
        shadow = self.shadow()
        cache, device = shadow.target.cache, self.target.lean.device
        cache.reset()
        cache.advance(0, 2)
        token_ids = torch.zeros((1, 1), dtype=torch.long, device=device)
        hidden = torch.zeros((1, 1, self.target.lean.hidden_size), dtype=self.target.lean.dtype, device=device)
        if greedy_steps:
            shadow.greedy_drafts(token_ids, hidden, cache.length, greedy_steps)
        else:
            shadow.step(token_ids, hidden, cache.length)
        cache.reset()
        return _stage_shadow_graphs(self._steps, shadow._steps, self.target.cache, cache)

    def _give_shadow_a_cache(self, shadow: 'FastAssistant') -> None:
        shadow.target = self.target.shadow()  # the assistant reads its target's cache

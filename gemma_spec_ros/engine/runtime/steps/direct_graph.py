"""
Compiled CPU step graphs called without dynamo's entry.

The torch.compile backend that records inductor's graphs (_DirectGraph) and one recorded graph with how to call it
(_DirectRecord).

The torch internals they need (inductor's compile_fx, dynamo's shape guards and argument sources) come through
torch_internals; where those are missing, steps.py compiles without this backend (torch_internals.direct_graphs).
"""

import types
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..ops import torch_internals


def _release_traced_module(graph: Callable) -> None:
    """
    Let the GraphModule dynamo traced be freed once inductor compiled it.

    AOTAutograd hangs the traced module's zero_grad / named_parameters / named_buffers on the compiled function and
    its wrappers, for convenience only: they kept every traced graph alive (~1,400 nodes with source stack traces and
    fake tensors for the bundled target's), which raised the serving peak (bench.fast_measure memory).
    """
    while graph is not None:
        for name in ('zero_grad', 'named_parameters', 'named_buffers'):
            getattr(graph, '__dict__', {}).pop(name, None)
        graph = getattr(graph, '__wrapped__', None)


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
        graph = torch_internals.compile_fx(graph_module, example_inputs, self._options)
        placeholders = [node for node in graph_module.graph.nodes if node.op == 'placeholder']
        bindings = [self._binding(node, value) for node, value in zip(placeholders, example_inputs, strict=True)]
        guards, guard_names = torch_internals.size_guards(
            [value for value in example_inputs if isinstance(value, torch.SymInt)])
        self._pending = None if None in bindings else _DirectRecord(graph, bindings, guards, guard_names)
        _release_traced_module(graph)
        return graph

    def _binding(self, node: torch.fx.Node, value) -> tuple | None:
        """('input', index) | ('size', index, dim) | ('fixed', value) for one graph argument; None: unknown."""
        source = torch_internals.argument_source(node, self.argument_names)
        if source is None or source[0] != 'other':
            return source
        if not isinstance(value, torch.Tensor):
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

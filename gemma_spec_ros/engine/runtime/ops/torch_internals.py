"""
Every use of torch's private APIs by the fast path, behind one probe of the torch version and the APIs.

The direct inductor graphs (direct_graph.py), the compile-cache handling (compile_cache.py) and inductor-gemm's
frozen-weight settings (steps.py) reach into torch internals that change between releases without notice. They
call them only through this module. missing() probes once: the torch version must lie in TESTED_TORCH (the releases
this was written and tested against) and each API in PRIVATE_APIS must exist. If not, every function here takes the
public path instead, and one TorchInternalsWarning says which API is missing (or which version runs) and what is used
instead:

- direct_graphs() is False: each CPU step variant is compiled with plain torch.compile (fullgraph, the same inductor
  options) and called through dynamo's entry, ~0.1-0.2 ms more a call, the same tokens;
- frozen_weight_settings() is a no-op context: the settings go into torch.compile's options (compile_options);
- clear_cache_artifacts() does nothing: torch keeps a copy of each cache artifact in memory;
- torch_default_cache_dir() is computed as torch computes it.

torch._dynamo.mark_dynamic and mark_static_address are documented (torch.compiler's dynamic-shapes and
static-address docs) and stable across releases, so they are used whatever the version; only where one is absent
(DOCUMENTED_APIS) do steps compile with automatic dynamic shapes (compile_dynamic() is None) or without static
weight addresses.
"""

import getpass
import importlib
import os
import re
import tempfile
import types
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch

# (lowest, highest) torch release, as (major, minor), that the private APIs below were written and tested against
TESTED_TORCH = ((2, 13), (2, 13))
# (module, attribute path) of each private API used
PRIVATE_APIS = (
    ('torch._inductor.compile_fx', 'compile_fx'),
    ('torch._guards', 'TracingContext'),
    ('torch.fx.experimental.symbolic_shapes', 'SYMPY_INTERP'),
    ('torch.fx.experimental.symbolic_shapes', 'ShapeEnv.produce_guards_expression'),
    ('torch.fx.experimental.symbolic_shapes', 'ShapeEnv.get_pruned_guards'),
    ('torch._dynamo.source', 'LocalSource'),
    ('torch._dynamo.source', 'TensorProperty'),
    ('torch._dynamo.source', 'TensorPropertySource'),
    ('torch._inductor.runtime.cache_dir_utils', 'default_cache_dir'),
    ('torch.compiler._cache', 'CacheArtifactManager'),
    ('torch._inductor.config', 'patch'),
)
# documented, used at any version where present
DOCUMENTED_APIS = (('torch._dynamo', 'mark_dynamic'), ('torch._dynamo', 'mark_static_address'))


class TorchInternalsWarning(UserWarning):
    """The fast path runs on torch's public compile path: a private API it uses is missing or untested."""


_probed: tuple[str | None, frozenset[str]] | None = None  # (why the private APIs are off, absent documented APIs)


def _resolve(module: str, path: str):
    """Return module.path (attributes may nest); raises ImportError or AttributeError where it is absent."""
    value = importlib.import_module(module)
    for name in path.split('.'):
        value = getattr(value, name)
    return value


def _torch_release(version: str) -> tuple[int, int] | None:
    match = re.match(r'(\d+)\.(\d+)', version)
    return (int(match[1]), int(match[2])) if match else None


def _probe() -> tuple[str | None, frozenset[str]]:
    """Probe once, warn once: (why the private APIs are not used, or None; names of absent documented APIs)."""
    global _probed
    if _probed is not None:
        return _probed
    reason = None
    release = _torch_release(torch.__version__)
    lowest, highest = TESTED_TORCH
    if release is None or not lowest <= release <= highest:
        reason = 'torch {} is outside the releases its private APIs were tested with ({}.{} to {}.{})'.format(
            torch.__version__, *lowest, *highest)
    for module, path in PRIVATE_APIS:
        if reason is not None:
            break
        try:
            _resolve(module, path)
        except (ImportError, AttributeError):
            reason = '{}.{} is missing in torch {}'.format(module, path, torch.__version__)
    absent = set()
    for module, path in DOCUMENTED_APIS:
        try:
            _resolve(module, path)
        except (ImportError, AttributeError):
            absent.add(path)
    _probed = (reason, frozenset(absent))
    notes = []
    if reason is not None:
        notes.append('{}: the fast path compiles its CPU steps with public torch.compile and calls them through '
                     "dynamo's entry instead of inductor's graphs directly (slower per call, same tokens); "
                     "inductor-gemm's settings go into torch.compile's options; torch's in-memory copy of cache "
                     'artifacts is kept'.format(reason))
    if absent:
        notes.append('torch._dynamo.{} is missing in torch {}: {}'.format(
            ' and '.join(sorted(absent)), torch.__version__,
            'steps compile with automatic dynamic shapes' if 'mark_dynamic' in absent else
            'frozen weights are not marked static'))
    if notes:
        warnings.warn('; '.join(notes), TorchInternalsWarning, stacklevel=3)
    return _probed


def missing() -> str | None:
    """Why the private APIs are not used (an API missing, an untested torch), or None when they are."""
    return _probe()[0]


def direct_graphs() -> bool:
    """Whether CPU step graphs can be compiled with inductor and called without dynamo (direct_graph.py)."""
    return missing() is None


# ----------------------------------------------------------------------------------------------------- compile
def compile_fx(graph_module: torch.fx.GraphModule, example_inputs: list, options: dict) -> Callable:
    """Compile a graph dynamo traced with inductor under options; only where direct_graphs()."""
    from torch._inductor.compile_fx import compile_fx as inductor_compile

    return inductor_compile(graph_module, example_inputs, config_patches=options)


def size_guards(sizes: list) -> tuple[types.CodeType | None, dict]:
    """
    Return dynamo's shape guards over sizes (the symbolic sizes of the graph being compiled), compiled, or None.

    Their code names the sizes L['t0'], L['t1'], ... and may call the functions of the returned dict. Called after
    compile_fx: it adds the guards of a graph taken from inductor's cache.
    """
    from torch._guards import TracingContext
    from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP

    if not sizes:
        return None, SYMPY_INTERP
    shape_env = TracingContext.get().fake_mode.shape_env
    guards = shape_env.produce_guards_expression(sizes, guards=shape_env.get_pruned_guards(sizes))
    return (compile(guards, '<size guards>', 'eval') if guards else None), SYMPY_INTERP


def argument_source(node: torch.fx.Node, argument_names: tuple[str, ...]) -> tuple | None:
    """
    Where dynamo took a graph placeholder's value from.

    ('input', index) an argument of the step, ('size', index, dim) a size of one, ('other',) elsewhere (a global or
    closed-over value), None without a source or from another property of an argument.
    """
    from torch._dynamo.source import LocalSource, TensorProperty, TensorPropertySource

    def argument_index(source) -> int | None:
        is_argument = isinstance(source, LocalSource) and not source.is_derefed_cell_contents and \
            source.local_name in argument_names
        return argument_names.index(source.local_name) if is_argument else None

    source = getattr(node.meta.get('grapharg'), 'source', None)
    index = argument_index(source)
    if index is not None:
        return ('input', index)
    if isinstance(source, TensorPropertySource):
        index = argument_index(source.base)
        if source.prop is not TensorProperty.SIZE or index is None:
            return None
        return ('size', index, source.idx)
    return None if source is None else ('other',)


def frozen_weight_settings(settings: dict) -> AbstractContextManager:
    """Inductor settings patched while a graph compiles (inductor-gemm); a no-op context on the public path."""
    if not direct_graphs():
        return nullcontext()
    return _resolve('torch._inductor.config', 'patch')(settings)


def compile_options(options: dict, frozen_settings: dict | None) -> dict:
    """torch.compile's options of a step on the public path: frozen_settings go there instead of a patch."""
    return options if direct_graphs() or not frozen_settings else {**options, **frozen_settings}


# ---------------------------------------------------------------------------------------------- dynamic shapes
def compile_dynamic() -> bool | None:
    """torch.compile's dynamic= for CPU steps: False (dimensions marked dynamic), None without mark_dynamic."""
    return None if 'mark_dynamic' in _probe()[1] else False


def mark_dynamic(tensor: torch.Tensor, dim: int) -> None:
    """Compile tensor's dim as a dynamic size (a no-op without mark_dynamic: compile_dynamic() is then None)."""
    if 'mark_dynamic' not in _probe()[1]:
        torch._dynamo.mark_dynamic(tensor, dim)


def mark_static_address(tensor: torch.Tensor) -> None:
    """Let compiled graphs treat tensor's storage as fixed (frozen weights may become constants)."""
    if 'mark_static_address' not in _probe()[1]:
        torch._dynamo.mark_static_address(tensor)


# ------------------------------------------------------------------------------------------------ compile cache
def torch_default_cache_dir() -> str:
    """Return torch's default inductor cache directory (computed as torch 2.13 does where its function is missing)."""
    if direct_graphs():
        return _resolve('torch._inductor.runtime.cache_dir_utils', 'default_cache_dir')()
    try:
        username = getpass.getuser()
    except (KeyError, ModuleNotFoundError, OSError):
        username = 'uid_{}'.format(os.getuid()) if hasattr(os, 'getuid') else 'unknown_user'
    return os.path.join(tempfile.gettempdir(), 'torchinductor_' + re.sub(r'[\\/:*?"<>|]', '_', username))


def clear_cache_artifacts() -> None:
    """Drop the bytes torch.compiler keeps of every cache artifact it wrote or read (nothing on the public path)."""
    if direct_graphs():
        _resolve('torch.compiler._cache', 'CacheArtifactManager').clear()

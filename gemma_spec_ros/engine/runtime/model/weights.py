"""
Loading a transformers model's weights into a lean model.

The flat per-dtype buffers they move into (FlatTensors), blocked matrices, 16-bit storage where it is exact
(store_exact_half), and one decoder layer's parts (_layer_parts).
"""

from dataclasses import dataclass
from typing import NamedTuple

import torch

from ...backend import return_freed_memory
from ..quant.quantize import QUANTIZED_MATRICES, QuantizedWeight, Quantizer
from .layers import ROW_PRODUCT_MAX_ROWS, _Shape, _Weights

# Outputs per block of a blocked matrix: one AVX-512 vector of float32.
BLOCK_WIDTH = 16


def blocked_shape(shape: torch.Size) -> torch.Size:
    """[out, in] -> [out / BLOCK_WIDTH, in, BLOCK_WIDTH]."""
    out_features, in_features = shape
    return torch.Size((out_features // BLOCK_WIDTH, in_features, BLOCK_WIDTH))


def block_matrix(weight: torch.Tensor) -> torch.Tensor:
    """
    Return weight [out, in] blocked, [out / BLOCK_WIDTH, in, BLOCK_WIDTH]: each block of outputs input-major.

    A compiled CPU product then reads each block as one contiguous run and keeps BLOCK_WIDTH outputs in one vector
    register across the whole input (_linear), instead of ending every output in a horizontal sum.
    """
    return weight.reshape(blocked_shape(weight.shape)[0], BLOCK_WIDTH, weight.shape[1]).transpose(1, 2).contiguous()


class FlatTensors:
    """
    The tensors a lean forward reads, packed into one flat buffer per dtype once they are all added.

    Added parameters and buffers are re-pointed into the flat buffers, so the transformers model shares them. A step
    compiled by torch.compile reads each tensor as a slice of its buffer: the graph then takes one input per dtype
    instead of one per tensor. Every input of a compiled call costs Python and C++ work (~2 us each, measured on 200
    inputs), and the bundled target's step read 170 tensors. Only for graphs without nested compile regions (CPU,
    layers inlined: _Decoder._packs_weights): a region's inputs must not alias each other.

    A matrix added with blocked=True is stored blocked (block_matrix) and its parameter becomes that 3-D tensor, so
    the transformers model's own forward, which would need the 2-D layout, fails instead of reading it wrong. A
    parameter that arrives blocked (another lean model on the same transformers model blocked it) stays blocked.
    """

    ALIGN = 16  # elements: each tensor starts on a 64-byte boundary in float32

    def __init__(self):
        self._tensors: list[torch.Tensor] = []
        self._handles: dict[int, int] = {}                   # id(tensor) -> handle (a tied weight is added once)
        self._blocked: set[int] = set()                      # handles of matrices to store blocked
        self._places: list[tuple[int, int, torch.Size]] = []  # per handle: buffer index, offset, shape
        self.buffers: list[torch.Tensor] = []

    def add(self, tensor: torch.Tensor | None, blocked: bool = False) -> int | None:
        """Return the handle of tensor (None for None); only before pack(). blocked: store a matrix blocked."""
        if tensor is None:
            return None
        if isinstance(tensor, QuantizedWeight):  # its integer data and its scales, each a tensor of its own
            return tensor._replace(data=self.add(tensor.data), scales=self.add(tensor.scales))
        assert not self.buffers, 'FlatTensors.add after pack'
        handle = self._handles.get(id(tensor))
        if handle is None:
            handle = self._handles[id(tensor)] = len(self._tensors)
            self._tensors.append(tensor)
        if blocked and tensor.dim() == 2 and tensor.shape[0] % BLOCK_WIDTH == 0:
            self._blocked.add(handle)
        return handle

    def add_each(self, tensors: NamedTuple, blocked: tuple[str, ...] = ()) -> NamedTuple:
        """Return the same named tuple with each tensor replaced by its handle; the named fields stored blocked."""
        return type(tensors)(*[self.add(tensor, name in blocked) for name, tensor in zip(tensors._fields, tensors,
                                                                                          strict=True)])

    def pack(self) -> None:
        """Copy every added tensor into the flat buffers and point it there."""
        dtypes = list(dict.fromkeys(tensor.dtype for tensor in self._tensors))
        ends = [0] * len(dtypes)
        for handle, tensor in enumerate(self._tensors):
            index = dtypes.index(tensor.dtype)
            shape = blocked_shape(tensor.shape) if handle in self._blocked else tensor.shape
            self._places.append((index, ends[index], shape))
            ends[index] += -(-tensor.numel() // self.ALIGN) * self.ALIGN
        devices = {tensor.device for tensor in self._tensors}
        assert len(devices) == 1, 'a lean model on several devices: {}'.format(devices)
        device = devices.pop()
        self.buffers = [torch.empty(end, dtype=dtype, device=device) for dtype, end in zip(dtypes, ends, strict=True)]
        for handle, tensor in enumerate(self._tensors):
            view = self._slice(handle)
            view.copy_(block_matrix(tensor.detach()) if handle in self._blocked else tensor)
            tensor.data = view
        return_freed_memory()

    def __getitem__(self, handle: int | None) -> torch.Tensor | None:
        return self._lookup()(handle)

    def each(self, handles: NamedTuple) -> NamedTuple:
        """Return the same named tuple with each handle replaced by its tensor."""
        lookup = self._lookup()
        return type(handles)(*[lookup(handle) for handle in handles])

    def _lookup(self):
        """Return handle -> tensor: a slice of the flat buffers while compiling packed tensors, else the tensor."""
        read = self._slice if self.buffers and torch.compiler.is_compiling() else self._tensors.__getitem__

        def lookup(handle):
            if isinstance(handle, QuantizedWeight):
                return handle._replace(data=read(handle.data), scales=read(handle.scales))
            return None if handle is None else read(handle)
        return lookup

    def _slice(self, handle: int) -> torch.Tensor:
        index, offset, shape = self._places[handle]
        return self.buffers[index][offset:offset + shape.numel()].view(shape)


def _stored(name: str) -> property:
    """Return a lean model's tensor attribute, read from its FlatTensors by the handle in _name."""
    handle = '_' + name
    return property(lambda self: self.tensors[getattr(self, handle)], doc='a tensor in self.tensors')


@dataclass
class _Layer:
    shape: _Shape
    kv_index: int        # the cache buffer it reads: its own, or its producer's when KV-shared
    weights: _Weights    # handles into the model's FlatTensors


def _text_parts(model):
    """(text model, lm_head, text config, multimodal config or None) of a Gemma 4 causal LM of either class."""
    inner = model.model
    if hasattr(inner, 'language_model'):    # Gemma4ForConditionalGeneration
        return inner.language_model, model.lm_head, model.config.get_text_config(), model.config
    return inner, model.lm_head, model.config, None


HALF_DTYPES = (torch.bfloat16, torch.float16)  # 16-bit storage of drafter weights, in order of preference


def exact_half_dtype(tensors: list[torch.Tensor]) -> torch.dtype | None:
    """Return bfloat16 or float16 when it holds every one of these float32 tensors exactly, else None."""
    for dtype in HALF_DTYPES:
        if all(torch.equal(tensor.to(dtype).float(), tensor) for tensor in tensors):
            return dtype
    return None


def store_exact_half(model) -> torch.dtype | None:
    """
    Store a float32 model's matrices (2-D parameters) in 16 bits where that loses nothing; returns the dtype.

    For the MTP assistant when inductor compiles its steps for CPU: they are memory-bound, and _linear converts each
    weight row to float32 as it reads it, so a step reads half the bytes and computes what float32 weights compute
    (checkpoints stored as bfloat16 or float16 load as exactly such values). The model's own forward no longer
    runs afterwards; only the lean forward does. None (nothing changed) when some matrix needs float32.
    """
    matrices = [p for p in model.parameters() if p.dim() == 2 and p.dtype == torch.float32]
    dtype = exact_half_dtype([p.detach() for p in matrices]) if matrices else None
    if dtype is not None:
        for parameter in matrices:
            parameter.data = parameter.data.to(dtype)
    return dtype


def _layer_parts(layer, kv_index: int, num_heads: int, eps: float, tensors: FlatTensors,
                 row_product_max_rows: int = ROW_PRODUCT_MAX_ROWS, blocked: bool = False,
                 quantizer: Quantizer | None = None) -> _Layer:
    if getattr(layer, 'enable_moe_block', False):
        raise ValueError('the fast path does not cover Gemma 4 MoE layers (enable_moe_block); use compile=off '
                         'with the transformers forward')
    attn = layer.self_attn
    shared = attn.is_kv_shared_layer
    ple = bool(layer.hidden_size_per_layer_input)
    v_proj = None if shared else attn.v_proj
    weights = _Weights(
        q_proj=attn.q_proj.weight, q_bias=attn.q_proj.bias, q_norm=attn.q_norm.weight,
        k_proj=None if shared else attn.k_proj.weight, k_bias=None if shared else attn.k_proj.bias,
        v_proj=None if v_proj is None else v_proj.weight, v_bias=None if v_proj is None else v_proj.bias,
        k_norm=None if shared else attn.k_norm.weight, o_proj=attn.o_proj.weight, o_bias=attn.o_proj.bias,
        input_norm=layer.input_layernorm.weight, post_attention_norm=layer.post_attention_layernorm.weight,
        pre_feedforward_norm=layer.pre_feedforward_layernorm.weight,
        post_feedforward_norm=layer.post_feedforward_layernorm.weight,
        gate_proj=layer.mlp.gate_proj.weight, up_proj=layer.mlp.up_proj.weight, down_proj=layer.mlp.down_proj.weight,
        layer_scalar=layer.layer_scalar,
        per_layer_gate=layer.per_layer_input_gate.weight if ple else None,
        per_layer_projection=layer.per_layer_projection.weight if ple else None,
        per_layer_norm=layer.post_per_layer_input_norm.weight if ple else None)
    if quantizer is not None:  # integer matrices are never blocked: their kernels read their own layouts
        weights = weights._replace(**{name: quantizer.matrix(getattr(weights, name)) for name in QUANTIZED_MATRICES})
        weights = weights._replace(per_layer_gate=quantizer.table(weights.per_layer_gate),
                                   per_layer_projection=quantizer.table(weights.per_layer_projection))
    # CUDA's int4 products are exact per row whatever the pass, but their bfloat16 inputs turn attention's tiny
    # pass-to-pass differences into whole rounding steps (greedy outputs then depended on K): float64 removes them
    shape = _Shape(attn.layer_type, num_heads, num_heads // attn.num_key_value_groups, attn.head_dim, eps,
                   row_product_max_rows,
                   None if quantizer is None else quantizer.attention_dtype(attn.o_proj.weight.device))
    return _Layer(shape, kv_index, tensors.add_each(weights, QUANTIZED_MATRICES if blocked else ()))



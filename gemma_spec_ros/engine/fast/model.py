"""
A lean Gemma 4 text forward over the weights of a loaded transformers model, for a static KV cache.

transformers stays the loader and the reference. On CPU the tensors a lean forward reads move into one flat buffer per
dtype (FlatTensors), and the transformers model's parameters point into them: nothing stays copied.
A step over q tokens takes token ids [1, q] and positions [q] as tensors; K/V slots and attention masks are computed
from them, so one graph (compiled or captured) serves every position. The only Python values a step depends on are
q, the number of logits kept and the full-attention key length (``kv_len``), which the runner fixes per graph.

Covered (each tested for parity against transformers): sliding and full layers with per-layer head_dim and KV heads,
q/k/v norms, rope per layer type (default and proportional / partial rotary), per-layer embeddings (PLE), KV sharing,
attention_k_eq_v, final logit softcapping, Gemma4ForConditionalGeneration's text model, and the MTP assistant
(Gemma4AssistantForCausalLM, including its ordered-embedding head). Not covered: MoE blocks (ValueError).
"""

import ctypes
import os
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .cache import EMPTY_POSITION, FULL, SLIDING, KvLayerSpec, StaticKvCache


@dataclass
class StepOutput:
    """What a lean pass returns, for the last n positions it was asked to keep."""

    logits: torch.Tensor          # [1, n, vocab] (final softcapping applied)
    hidden: torch.Tensor | None   # [1, n, hidden] final-norm hidden states (what the MTP assistant reads)
    shared_kv_states: dict | None = None  # transformers' forward only: {layer_type: (keys, values)} for its assistant
    greedy_row: torch.Tensor | None = None  # [n + 2] a fast verify pass's greedy verify() of its tokens after the
    #                                         first as drafts: accepted count, the n - 1 drafts, -1, next token


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
        return lambda handle: None if handle is None else read(handle)

    def _slice(self, handle: int) -> torch.Tensor:
        index, offset, shape = self._places[handle]
        return self.buffers[index][offset:offset + shape.numel()].view(shape)


def return_freed_memory() -> None:
    """
    Return the memory glibc's heap keeps after frees to the OS (malloc_trim; a no-op without glibc).

    After the weights moved into FlatTensors, the bundled target's old storages (34 MB) otherwise stayed resident.
    """
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


def _stored(name: str) -> property:
    """Return a lean model's tensor attribute, read from its FlatTensors by the handle in _name."""
    handle = '_' + name
    return property(lambda self: self.tensors[getattr(self, handle)], doc='a tensor in self.tensors')


class _Weights(NamedTuple):
    """One decoder layer's parameters (tensors of the transformers model); None where the layer has none."""

    q_proj: torch.Tensor
    q_bias: torch.Tensor | None
    q_norm: torch.Tensor
    k_proj: torch.Tensor | None          # None: KV-shared layer (reads its producer's K/V, writes nothing)
    k_bias: torch.Tensor | None
    v_proj: torch.Tensor | None          # None with attention_k_eq_v: values are the raw key projection
    v_bias: torch.Tensor | None
    k_norm: torch.Tensor | None
    o_proj: torch.Tensor
    o_bias: torch.Tensor | None
    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    pre_feedforward_norm: torch.Tensor
    post_feedforward_norm: torch.Tensor
    gate_proj: torch.Tensor
    up_proj: torch.Tensor
    down_proj: torch.Tensor
    layer_scalar: torch.Tensor
    per_layer_gate: torch.Tensor | None        # per-layer embeddings (PLE)
    per_layer_projection: torch.Tensor | None
    per_layer_norm: torch.Tensor | None


@dataclass(frozen=True)
class _Shape:
    """The Python constants of one decoder layer."""

    layer_type: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    row_product_max_rows: int  # _linear's


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


def _rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    # as Gemma4RMSNorm: in float32, weight applied directly (no 1 + weight)
    return F.rms_norm(x.float(), (x.shape[-1],), None if weight is None else weight.float(), eps).type_as(x)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [q, heads, head_dim], cos/sin [q, 1, head_dim]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Attend query [q, heads, d] to keys/values [kv_heads, L, d] where mask [q, L] -> [q, heads * d] (scale 1)."""
    out = F.scaled_dot_product_attention(query.transpose(0, 1)[None], keys[None], values[None], attn_mask=mask,
                                         scale=1.0, enable_gqa=keys.shape[0] != query.shape[1])
    return out[0].transpose(0, 1).reshape(query.shape[0], -1)


def _compiling_for_cpu(x: torch.Tensor) -> bool:
    return x.device.type == 'cpu' and torch.compiler.is_compiling()


def _mkl_runs_tuned_code() -> bool:
    """Whether aten's CPU matrix product runs MKL's tuned code: MKL takes it on Intel CPUs only (elsewhere generic)."""
    if not torch.backends.mkl.is_available():
        return False
    try:
        with open('/proc/cpuinfo') as cpuinfo:
            return 'GenuineIntel' in cpuinfo.read()
    except OSError:
        return False


# A lower value than the CPU's shortens the first compile (a graph per pass length up to it), at some speed cost.
ROW_PRODUCT_MAX_ROWS_ENV = 'GEMMA_SPEC_ROW_PRODUCT_MAX_ROWS'


def _row_product_max_rows() -> int:
    """
    Return the longest pass whose products a compiled CPU step computes as multiply-reduces (_linear).

    ROW_PRODUCT_MAX_ROWS_ENV sets it where set. Otherwise up to there each is faster than aten's product, as
    measured on the bundled target (compiled passes, 1 thread). On an Intel Xeon, where MKL runs its tuned code, the
    multiply-reduce made a one-row step 1.16x faster than aten's matrix-vector product, but aten's product of 2 rows
    cost about what one row did. Where MKL runs its generic code, inductor's vectorised loops win: with AVX2 (AMD
    EPYC) through 4 rows (passes of 2 / 3 / 4 tokens 10.0 / 12.2 / 13.5 -> 8.1 / 9.7 / 12.4 ms; equal at 5, slower
    from 6), with AVX-512 (AMD EPYC) through 9 (passes of 5 / 9 tokens 10.2 / 11.4 -> 6.3 / 8.4 ms; equal at 12,
    slower at 17).
    """
    override = os.environ.get(ROW_PRODUCT_MAX_ROWS_ENV, '')
    if override:
        if not override.isdigit() or int(override) < 1:
            raise ValueError('{} must be a whole number of rows >= 1, got {!r}'.format(ROW_PRODUCT_MAX_ROWS_ENV,
                                                                                      override))
        return int(override)
    if _mkl_runs_tuned_code():
        return 1
    return 9 if torch.backends.cpu.get_cpu_capability() == 'AVX512' else 4


# Read before any step is traced: dynamo sees a constant.
ROW_PRODUCT_MAX_ROWS = _row_product_max_rows()


# Longest eager pass (prefill) whose products with a blocked matrix run block by block, which beats one product on an
# unblocked copy up to about here (the bundled target's 768 x 192 matrices, 1 thread: 20 rows 102 against 191 us,
# 60 rows equal, 200 rows 773 against 725 us, 400 rows 3.5 against 1.3 ms).
BLOCKED_BATCH_MAX_ROWS = 128


def _row_product(row: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Return row [in] times weight [out, in] (or blocked) transposed: [out], as a multiply-reduce."""
    if weight.dim() == 3:
        return (weight * row[:, None]).sum(1).flatten()   # [blocks, in, width] summed over in
    return (weight * row).sum(-1)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
            row_product_max_rows: int = ROW_PRODUCT_MAX_ROWS) -> torch.Tensor:
    """
    Return x [q, in] times weight [out, in] (or blocked: block_matrix) transposed, plus bias: [q, out].

    Compiled for CPU, a pass of up to row_product_max_rows rows is a multiply-reduce per row, which inductor fuses into
    one loop per output (per block of outputs, one vector wide, for a blocked weight): it reads the weight once for
    all rows and converts a 16-bit weight (store_exact_half) on the fly; only the summation order changes. Longer
    passes and eager runs keep aten's product (a 16-bit weight is converted, a blocked one multiplied block by block
    or unblocked, so a step that dynamo runs eager after all, say past its recompile limit, stays correct), which
    inductor's C++ GEMM template generates in graphs compiled on frozen weights (runner: engine.compile
    inductor-gemm).
    """
    blocked = weight.dim() == 3
    if _compiling_for_cpu(x) and x.shape[0] <= row_product_max_rows:  # q is static here (runner.query_variant)
        rows = x.as_strided(x.shape, x.stride()).unbind(0)  # a view inductor keeps: x is computed once, not per output
        out = torch.stack([_row_product(row, weight) for row in rows])  # inductor fuses the rows into one loop
        return out if bias is None else out + bias
    if blocked and x.shape[0] > BLOCKED_BATCH_MAX_ROWS:  # a long prefill: one product on an unblocked copy
        weight, blocked = weight.transpose(1, 2).flatten(0, 1), False
    if not blocked:
        return F.linear(x, weight.to(x.dtype), bias)
    out = torch.matmul(x, weight.to(x.dtype)).transpose(0, 1).flatten(1)  # a product per block: [blocks, q, width]
    return out if bias is None else out + bias


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


class _Rope:
    """cos/sin per layer type from the model's inverse frequencies, computed as transformers computes them."""

    def __init__(self, rotary_emb, layer_types, dtype: torch.dtype, tensors: FlatTensors):
        self.dtype = dtype
        self.tensors = tensors
        self.inv_freq = {kind: tensors.add(getattr(rotary_emb, '{}_inv_freq'.format(kind)))
                         for kind in sorted(set(layer_types))}
        self.scaling = {kind: getattr(rotary_emb, '{}_attention_scaling'.format(kind)) for kind in self.inv_freq}

    def at(self, positions: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """{layer_type: (cos, sin)} each [q, 1, head_dim] for positions [q]."""
        rope = {}
        for kind, handle in self.inv_freq.items():
            freqs = positions[:, None].float() * self.tensors[handle].float()[None, :]
            angles = torch.cat((freqs, freqs), dim=-1)[:, None]
            scaling = self.scaling[kind]
            rope[kind] = ((angles.cos() * scaling).to(self.dtype), (angles.sin() * scaling).to(self.dtype))
        return rope


# A layer's matrices, which a lean model may store blocked (block_matrix).
_LAYER_MATRICES = ('q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj')


def _layer_parts(layer, kv_index: int, num_heads: int, eps: float, tensors: FlatTensors,
                 row_product_max_rows: int = ROW_PRODUCT_MAX_ROWS, blocked: bool = False) -> _Layer:
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
    shape = _Shape(attn.layer_type, num_heads, num_heads // attn.num_key_value_groups, attn.head_dim, eps,
                   row_product_max_rows)
    return _Layer(shape, kv_index, tensors.add_each(weights, _LAYER_MATRICES if blocked else ()))


def _project(shape: _Shape, w: _Weights, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Input norm, query and (producing layers) new keys and values: [q, heads, d], [kv_heads, q, d] x 2."""
    q, rows = hidden.shape[0], shape.row_product_max_rows
    x = _rms_norm(hidden, w.input_norm, shape.eps)
    query = _linear(x, w.q_proj, w.q_bias, rows).view(q, shape.num_heads, shape.head_dim)
    query = _rotate(_rms_norm(query, w.q_norm, shape.eps), cos, sin)
    if w.k_proj is None:
        return query, None, None
    raw_keys = _linear(x, w.k_proj, w.k_bias, rows).view(q, shape.num_kv_heads, shape.head_dim)
    values = raw_keys if w.v_proj is None else _linear(x, w.v_proj, w.v_bias, rows).view(
        q, shape.num_kv_heads, shape.head_dim)
    keys = _rotate(_rms_norm(raw_keys, w.k_norm, shape.eps), cos, sin).transpose(0, 1)
    return query, keys, _rms_norm(values, None, shape.eps).transpose(0, 1)


def _finish(shape: _Shape, w: _Weights, hidden: torch.Tensor, attended: torch.Tensor,
            per_layer_input: torch.Tensor | None) -> torch.Tensor:
    """Output projection, feed-forward and per-layer input of a decoder layer, given the attention output."""
    eps, rows = shape.eps, shape.row_product_max_rows
    hidden = hidden + _rms_norm(_linear(attended, w.o_proj, w.o_bias, rows), w.post_attention_norm, eps)
    x = _rms_norm(hidden, w.pre_feedforward_norm, eps)
    gated = F.gelu(_linear(x, w.gate_proj, None, rows), approximate='tanh') * _linear(x, w.up_proj, None, rows)
    hidden = hidden + _rms_norm(_linear(gated, w.down_proj, None, rows), w.post_feedforward_norm, eps)
    if per_layer_input is not None:
        x = F.gelu(_linear(hidden, w.per_layer_gate, None, rows), approximate='tanh') * per_layer_input
        hidden = hidden + _rms_norm(_linear(x, w.per_layer_projection, None, rows), w.per_layer_norm, eps)
    return hidden * w.layer_scalar


def _step_layer(shape: _Shape, w: _Weights, hidden: torch.Tensor, per_layer_input: torch.Tensor | None,
                cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                slots: torch.Tensor) -> torch.Tensor:
    """
    Run one decoder layer of a step.

    New K/V are written at slots, then the query attends to keys/values [kv_heads, slots, d] where mask [q, L]
    (full layers read the first L slots).
    """
    query, new_keys, new_values = _project(shape, w, hidden, cos, sin)
    if new_keys is not None:
        keys.index_copy_(1, slots, new_keys)
        values.index_copy_(1, slots, new_values)
    if shape.layer_type == FULL:
        keys, values = keys[:, :mask.shape[-1]], values[:, :mask.shape[-1]]
    return _finish(shape, w, hidden, _attend(query, keys, values, mask), per_layer_input)


# A layer is compiled once per layer shape and reused (hierarchical compilation), which keeps the compile time
# independent of the depth. Compiled for CPU, a model of at most INLINE_MAX_LAYERS layers inlines them into one graph
# instead: inductor then writes the graph's wrapper in C++ (runner: cpp_wrapper, which cannot call a nested region),
# and a step runs its kernels without Python between them (bundled 12-layer target: plain step 8.8 -> 7.7 ms in an
# A/B, its cold compile 1.8x longer). Deeper models (Gemma-4-E2B: 35 layers) keep the regions: their compile time
# would grow with the depth.
_step_layer_region = torch.compiler.nested_compile_region(_step_layer)
INLINE_MAX_LAYERS = 16


def inlines_layers(num_layers: int) -> bool:
    """Whether steps compiled for CPU inline a model's layers into one graph (else one region per layer shape)."""
    return num_layers <= INLINE_MAX_LAYERS


def _check_activation(config) -> None:
    if config.hidden_activation != 'gelu_pytorch_tanh':
        raise ValueError('the fast path supports hidden_activation gelu_pytorch_tanh, got {!r}'.format(
            config.hidden_activation))


@dataclass
class _Pass:
    """What every layer of one pass reads besides its weights."""

    cache: StaticKvCache
    positions: torch.Tensor                           # [q] positions of the new tokens
    rope: dict[str, tuple[torch.Tensor, torch.Tensor]]
    masks: dict[str, torch.Tensor]                    # layer type -> [q, keys] bool
    kv_len: int                                       # full layers read slots 0..kv_len-1
    # prefill only: new sliding K/V per cache buffer, read beside the old ring and written into it after the pass
    pending: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None


class _Decoder:
    """Decoder layers shared by the causal LM and the assistant."""

    layers: list[_Layer]
    tensors: FlatTensors

    @property
    def inlines_layers(self) -> bool:
        """Whether steps compiled for CPU inline the layers into one graph (else one region per layer shape)."""
        return inlines_layers(len(self.layers))

    def _packs_weights(self, device: torch.device) -> bool:
        """Whether the weights go into flat buffers: when every compiled step is one graph (CPU, layers inlined)."""
        return self.inlines_layers and device.type == 'cpu'

    def _layers(self, hidden: torch.Tensor, state: _Pass, per_layer: torch.Tensor | None) -> torch.Tensor:
        cache = state.cache
        slots = {kind: cache.write_slots(kind, state.positions) for kind in (FULL, SLIDING)}
        step_layer = _step_layer if self.inlines_layers and _compiling_for_cpu(hidden) else _step_layer_region
        for index, layer in enumerate(self.layers):
            kind = layer.shape.layer_type
            weights = self.tensors.each(layer.weights)
            cos, sin = state.rope[kind]
            per_layer_input = None if per_layer is None else per_layer[:, index]
            keys, values = cache.keys[layer.kv_index], cache.values[layer.kv_index]
            if state.pending is None:
                hidden = step_layer(layer.shape, weights, hidden, per_layer_input, cos, sin, state.masks[kind],
                                    keys, values, slots[kind])
                continue
            # prefill: full layers write all new K/V first; sliding layers read the old ring beside the new K/V,
            # which go into the ring after the pass
            query, new_keys, new_values = _project(layer.shape, weights, hidden, cos, sin)
            if new_keys is not None:
                if kind == FULL:
                    keys.index_copy_(1, slots[kind], new_keys)
                    values.index_copy_(1, slots[kind], new_values)
                else:
                    state.pending[layer.kv_index] = (new_keys, new_values)
            if kind == FULL:
                keys, values = keys[:, :state.kv_len], values[:, :state.kv_len]
            else:
                new_keys, new_values = state.pending[layer.kv_index]
                keys, values = torch.cat((keys, new_keys), dim=1), torch.cat((values, new_values), dim=1)
            hidden = _finish(layer.shape, weights, hidden, _attend(query, keys, values, state.masks[kind]),
                             per_layer_input)
        return hidden


class LeanGemma4(_Decoder):
    """
    Gemma4ForCausalLM or Gemma4ForConditionalGeneration (text only) as a lean, static-shape forward.

    Build it after the model is on its final device and dtype: it may move the parameters it reads into its
    FlatTensors.
    """

    embed = _stored('embed')                              # [vocab, hidden]
    embed_scale = _stored('embed_scale')
    lm_head = _stored('lm_head')                          # [vocab, hidden]
    final_norm = _stored('final_norm')
    per_layer_embed = _stored('per_layer_embed')          # [vocab_per_layer, layers * per_layer]
    per_layer_embed_scale = _stored('per_layer_embed_scale')
    per_layer_model_projection = _stored('per_layer_model_projection')
    per_layer_projection_norm = _stored('per_layer_projection_norm')

    def __init__(self, model, row_product_max_rows: int = ROW_PRODUCT_MAX_ROWS, blocked: bool = False):
        """
        Read the model's weights; pack them where every compiled step is one graph (_packs_weights).

        row_product_max_rows: the longest compiled CPU pass whose products are multiply-reduces (_linear).
        blocked: store the layers' matrices blocked (block_matrix) where the weights are packed.
        """
        text_model, lm_head, config, multimodal = _text_parts(model)
        _check_activation(config)
        if getattr(config, 'use_bidirectional_attention', None) == 'all':
            raise ValueError('the fast path needs causal attention; use_bidirectional_attention="all" is not covered')
        self.eps = config.rms_norm_eps
        self.sliding_window = config.sliding_window
        self.softcap = config.final_logit_softcapping
        self.row_product_max_rows = row_product_max_rows
        weight = text_model.embed_tokens.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.tensors = tensors = FlatTensors()
        self._embed = tensors.add(weight)
        self._embed_scale = tensors.add(text_model.embed_tokens.embed_scale.to(self.dtype))
        self._lm_head = tensors.add(lm_head.weight)
        self._final_norm = tensors.add(text_model.norm.weight)
        self.hidden_size = config.hidden_size
        # multimodal placeholder ids are replaced by pad before embedding, as Gemma4Model does
        self.placeholder_ids = [] if multimodal is None else [
            getattr(multimodal, name) for name in ('image_token_id', 'video_token_id', 'audio_token_id')
            if getattr(multimodal, name, None) is not None]
        self.pad_token_id = config.pad_token_id
        self.per_layer_size = config.hidden_size_per_layer_input
        if self.per_layer_size:
            self._per_layer_embed = tensors.add(text_model.embed_tokens_per_layer.weight)
            self._per_layer_embed_scale = tensors.add(text_model.embed_tokens_per_layer.embed_scale.to(self.dtype))
            self._per_layer_model_projection = tensors.add(text_model.per_layer_model_projection.weight)
            self.per_layer_projection_scale = text_model.per_layer_model_projection_scale
            self._per_layer_projection_norm = tensors.add(text_model.per_layer_projection_norm.weight)
            self.per_layer_input_scale = text_model.per_layer_input_scale

        self.kv_specs: list[KvLayerSpec] = []
        producer_of: dict[str, int] = {}
        self.layers = []
        for index, layer in enumerate(text_model.layers[:config.num_hidden_layers]):
            attn = layer.self_attn
            if attn.is_kv_shared_layer:
                kv_index = producer_of[attn.layer_type]
            else:
                kv_index = len(self.kv_specs)
                num_kv_heads = attn.k_proj.out_features // attn.head_dim
                self.kv_specs.append(KvLayerSpec(index, attn.layer_type, num_kv_heads, attn.head_dim))
                producer_of[attn.layer_type] = kv_index
            self.layers.append(_layer_parts(layer, kv_index, config.num_attention_heads, self.eps, tensors,
                                            row_product_max_rows, blocked))
        self.rope = _Rope(text_model.rotary_emb, config.layer_types, self.dtype, tensors)
        if self._packs_weights(self.device):
            tensors.pack()

    def new_cache(self, context_limit: int, max_query: int) -> StaticKvCache:
        """Make a static cache for this model: context_limit tokens, steps of up to max_query tokens."""
        return StaticKvCache(self.kv_specs, context_limit, self.sliding_window, max_query, self.device, self.dtype)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Scaled token embedding [..., hidden] (what the MTP assistant's input starts with)."""
        return F.embedding(input_ids, self.embed) * self.embed_scale

    def _inputs(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """input_ids [q] -> embeddings [q, hidden] and per-layer inputs [q, layers, per_layer] (or None)."""
        for placeholder in self.placeholder_ids:
            input_ids = torch.where(input_ids == placeholder, self.pad_token_id, input_ids)
        embeds = self.embed_tokens(input_ids)
        if not self.per_layer_size:
            return embeds, None
        q = input_ids.shape[0]
        token_part = (F.embedding(input_ids, self.per_layer_embed) * self.per_layer_embed_scale).view(
            q, len(self.layers), self.per_layer_size)
        context_part = (_linear(embeds, self.per_layer_model_projection, None, self.row_product_max_rows)
                        * self.per_layer_projection_scale)
        context_part = _rms_norm(context_part.view(q, len(self.layers), self.per_layer_size),
                                 self.per_layer_projection_norm, self.eps)
        return embeds, (context_part + token_part) * self.per_layer_input_scale

    def _head(self, hidden: torch.Tensor) -> StepOutput:
        hidden = _rms_norm(hidden, self.final_norm, self.eps)
        logits = _linear(hidden, self.lm_head, None, self.row_product_max_rows)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return StepOutput(logits.unsqueeze(0), hidden.unsqueeze(0))

    def step(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: StaticKvCache, kv_len: int,
             logits_to_keep: int) -> StepOutput:
        """
        One static-shape pass: input_ids [1, q] at positions [q] (consecutive), K/V written into the cache.

        Full layers attend over cache slots 0..kv_len-1 (kv_len > the last position), sliding layers over their
        ring; masks come from the position tensors. Keeps the last logits_to_keep positions. No host syncs, no
        Python value depends on the positions: safe to compile or capture. The caller records the write
        (``cache.advance``).
        """
        hidden, per_layer = self._inputs(input_ids[0])
        cache.ring_positions.index_copy_(0, positions % cache.ring_size, positions)
        query_positions = positions[:, None]
        ring = cache.ring_positions[None, :]
        masks = {FULL: cache.key_positions[None, :kv_len] <= query_positions,
                 SLIDING: (ring <= query_positions) & (ring > query_positions - self.sliding_window)}
        hidden = self._layers(hidden, _Pass(cache, positions, self.rope.at(positions), masks, kv_len), per_layer)
        return self._head(hidden[-logits_to_keep:])

    def prefill(self, input_ids: torch.Tensor, cache: StaticKvCache, start: int, logits_to_keep: int) -> StepOutput:
        """
        Any number of tokens [1, n] at positions start.. (eager, dynamic shapes): the prompt, or a long extension.

        Sliding layers attend over [ring entries before start, new keys]; the last ring_size new keys are written
        into the ring after the pass. Records the write in the cache.
        """
        count = input_ids.shape[1]
        cache.check_write(start, count)
        positions = torch.arange(start, start + count, device=self.device)
        hidden, per_layer = self._inputs(input_ids[0])
        query_positions = positions[:, None]
        old_ring = cache.ring_positions
        old_ring = torch.where(old_ring < start, old_ring, torch.full_like(old_ring, EMPTY_POSITION))
        sliding_keys = torch.cat((old_ring, positions))[None, :]
        masks = {FULL: cache.key_positions[None, :start + count] <= query_positions,
                 SLIDING: (sliding_keys <= query_positions) & (sliding_keys > query_positions - self.sliding_window)}
        state = _Pass(cache, positions, self.rope.at(positions), masks, start + count, pending={})
        hidden = self._layers(hidden, state, per_layer)
        kept = positions[-cache.ring_size:]
        slots = kept % cache.ring_size
        for kv_index, (new_keys, new_values) in state.pending.items():
            cache.keys[kv_index].index_copy_(1, slots, new_keys[:, -cache.ring_size:])
            cache.values[kv_index].index_copy_(1, slots, new_values[:, -cache.ring_size:])
        cache.ring_positions.index_copy_(0, slots, kept)
        cache.advance(start, count)
        return self._head(hidden[-logits_to_keep:])


class LeanAssistant(_Decoder):
    """
    Gemma4AssistantForCausalLM as one static-shape MTP draft step reading the target's static cache.

    Every layer reads the K/V of the target's last producing layer of its type. For the assistant at position p
    (the last emitted token, not yet in the target cache), full layers see positions 0..p-1 and sliding layers
    the window + 1 positions p-window-1..p-1: what transformers' assistant sees when it is handed the target's
    shared K/V after prefill or after a round that accepted a draft.

    Build it after the assistant is on its final device and dtypes: it may move the parameters it reads into its
    FlatTensors.
    """

    pre_projection = _stored('pre_projection')    # [hidden, 2 * backbone]
    post_projection = _stored('post_projection')  # [backbone, hidden]
    final_norm = _stored('final_norm')
    lm_head = _stored('lm_head')
    centroids = _stored('centroids')              # [num_centroids, hidden]
    token_ordering = _stored('token_ordering')    # [vocab]

    def __init__(self, assistant, target: LeanGemma4):
        text_model = assistant.model
        config = assistant.config.get_text_config()
        _check_activation(config)
        if assistant.config.backbone_hidden_size != target.hidden_size:
            raise ValueError('MTP assistant backbone_hidden_size {} differs from the target hidden_size {}'.format(
                assistant.config.backbone_hidden_size, target.hidden_size))
        if SLIDING in config.layer_types and config.sliding_window > target.sliding_window:
            raise ValueError('MTP assistant sliding_window {} exceeds the target sliding_window {}: the target '
                             'cache does not keep that much'.format(config.sliding_window, target.sliding_window))
        self.eps = config.rms_norm_eps
        self.sliding_window = config.sliding_window
        self.target = target
        producers = {spec.layer_type: index for index, spec in enumerate(target.kv_specs)}  # last one of each type
        self.tensors = tensors = FlatTensors()
        self.layers = []
        for index, layer in enumerate(text_model.layers[:config.num_hidden_layers]):
            attn = layer.self_attn
            if attn.layer_type not in producers:
                raise ValueError('MTP assistant layer {} reads {} K/V, which the target does not produce'.format(
                    index, attn.layer_type))
            parts = _layer_parts(layer, producers[attn.layer_type], config.num_attention_heads, self.eps, tensors)
            spec = target.kv_specs[parts.kv_index]
            if (parts.shape.head_dim, parts.shape.num_kv_heads) != (spec.head_dim, spec.num_kv_heads):
                raise ValueError('MTP assistant layer {} ({}) expects head_dim {} and {} KV heads but the target '
                                 'provides {} and {}'.format(index, attn.layer_type, parts.shape.head_dim,
                                                             parts.shape.num_kv_heads, spec.head_dim,
                                                             spec.num_kv_heads))
            self.layers.append(parts)
        self._pre_projection = tensors.add(assistant.pre_projection.weight)
        self._post_projection = tensors.add(assistant.post_projection.weight)
        self._final_norm = tensors.add(text_model.norm.weight)
        self._lm_head = tensors.add(assistant.lm_head.weight)
        self.rope = _Rope(text_model.rotary_emb, config.layer_types, target.dtype, tensors)
        embedder = assistant.masked_embedding
        self.ordered = embedder is not None
        if self.ordered:
            self._centroids = tensors.add(embedder.centroids.weight)
            self.top_k = embedder.centroid_intermediate_top_k
            self._token_ordering = tensors.add(embedder.token_ordering)  # a buffer, read at every step
            self.num_centroids = embedder.num_centroids
        if self._packs_weights(target.device):
            tensors.pack()

    def step(self, token_ids: torch.Tensor, hidden: torch.Tensor, position: torch.Tensor, cache: StaticKvCache,
             kv_len: int) -> StepOutput:
        """
        Run one draft step.

        token_ids [1, 1] is the last token, hidden [1, 1, backbone] the target state that predicted it (or the
        previous step's output), position [1] its position. Returns logits [1, 1, vocab] and the projected hidden
        [1, 1, backbone] to feed the next step. kv_len > position bounds the full-layer keys read.
        """
        inputs = torch.cat((self.target.embed_tokens(token_ids[0]), hidden[0]), dim=-1)  # [1, 2 * backbone]
        x = _linear(inputs, self.pre_projection)
        before = position[:, None] - 1
        ring = cache.ring_positions[None, :]
        masks = {FULL: cache.key_positions[None, :kv_len] <= before,
                 SLIDING: (ring <= before) & (ring >= before - self.sliding_window)}
        x = self._layers(x, _Pass(cache, position, self.rope.at(position), masks, kv_len), None)
        x = _rms_norm(x, self.final_norm, self.eps)
        logits = self._ordered_logits(x) if self.ordered else _linear(x, self.lm_head)
        return StepOutput(logits.unsqueeze(0), _linear(x, self.post_projection).unsqueeze(0))

    def _ordered_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Logits [1, vocab] from x [1, hidden]: exact for the tokens of the top centroids, the rest below their min."""
        top = torch.topk(_linear(x, self.centroids), k=self.top_k, dim=-1).indices                # [1, top_k]
        clusters = self.token_ordering.long().view(self.num_centroids, -1)
        selected = clusters[top].reshape(1, -1)                                                  # [1, top_k * per]
        selected_logits = _linear(x, self.lm_head[selected[0]])                                  # [1, top_k * per]
        floor = selected_logits.min() - 1.0
        return floor.expand(1, self.lm_head.shape[0]).clone().scatter_(-1, selected, selected_logits)

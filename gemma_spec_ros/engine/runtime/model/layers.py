"""
The arithmetic of one decoder layer of the lean forward.

Norms, rope rotation, attention, the matrix products (_linear, with its CPU multiply-reduce form) and the
feed-forward, over one layer's weights (_Weights) and constants (_Shape). model.py runs these layer by layer;
weights.py loads what they read.
"""

import os
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..ops import cpu_ops
from ..quant.quantize import QuantizedWeight, int8_feed_forward_together, int8_together, quantized_linear
from .cache import FULL


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
    # attention in float64 (quantized models): its result then does not depend on how many queries share the pass
    attention_dtype: torch.dtype | None = None


def _rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    # as Gemma4RMSNorm: in float32, weight applied directly (no 1 + weight)
    return F.rms_norm(x.float(), (x.shape[-1],), None if weight is None else weight.float(), eps).type_as(x)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [q, heads, head_dim], cos/sin [q, 1, head_dim]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
            dtype: torch.dtype | None = None) -> torch.Tensor:
    """
    Attend query [q, heads, d] to keys/values [kv_heads, L, d] where mask [q, L] -> [q, heads * d] (scale 1).

    dtype: compute in it (float64: _Shape.attention_dtype), the result in query's dtype.
    """
    if dtype is not None:
        return _attend(query.to(dtype), keys.to(dtype), values.to(dtype), mask).to(query.dtype)
    if _attends_through_op(query):
        return cpu_ops.decode_attention(query, keys, values, mask)
    out = F.scaled_dot_product_attention(query.transpose(0, 1)[None], keys[None], values[None], attn_mask=mask,
                                         scale=1.0, enable_gqa=keys.shape[0] != query.shape[1])
    return out[0].transpose(0, 1).reshape(query.shape[0], -1)


def _attend_rows(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                 dtype: torch.dtype | None = None) -> torch.Tensor:
    """
    Attend each batch row's query to its own keys and values (scale 1), computed in dtype as _attend.

    query [B * Q, heads, d], keys/values [B, kv_heads, L, d], mask [B, Q, L] -> [B * Q, heads * d].
    """
    if dtype is not None:
        return _attend_rows(query.to(dtype), keys.to(dtype), values.to(dtype), mask).to(query.dtype)
    rows, length = mask.shape[0], mask.shape[1]
    query = query.view(rows, length, query.shape[1], query.shape[2]).transpose(1, 2)  # [B, heads, Q, d]
    out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask[:, None], scale=1.0,
                                         enable_gqa=keys.shape[1] != query.shape[1])
    return out.transpose(1, 2).reshape(rows * length, -1)


def _compiling_for_cpu(x: torch.Tensor) -> bool:
    return x.device.type == 'cpu' and torch.compiler.is_compiling()


# The longest eager CPU pass that attends through the op; a longer prefill keeps SDPA's blocked kernel, faster there.
EAGER_ATTENTION_OP_MAX_QUERIES = 16


def _attends_through_op(query: torch.Tensor) -> bool:
    """
    Whether a CPU pass attends through cpu_ops.decode_attention: compiled steps, and eager steps and verify passes.

    The op costs less a call than SDPA's kernel, and its rows are exact whatever the pass, so eager verify passes
    give the bits of eager one-token steps: with int8's rounded activations SDPA's last-bit differences between
    pass sizes could otherwise change a greedy token where two logits almost tie.
    """
    if query.device.type != 'cpu' or not cpu_ops.attention_usable(query):
        return False
    return torch.compiler.is_compiling() or query.shape[0] <= EAGER_ATTENTION_OP_MAX_QUERIES


def _mkl_runs_tuned_code() -> bool:
    """Whether aten's CPU matrix product runs MKL's tuned code: MKL takes it on Intel CPUs only (elsewhere generic)."""
    if not torch.backends.mkl.is_available():
        return False
    return 'GenuineIntel' in cpu_ops.cpu_info()


# The test suite's override of engine.row_product_max_rows (fewer graphs to compile on a cold cache: test/conftest.py).
ROW_PRODUCT_MAX_ROWS_ENV = 'GEMMA_SPEC_ROW_PRODUCT_MAX_ROWS'


def cpu_row_product_max_rows() -> int:
    """
    Return the longest pass whose products a compiled CPU step computes as multiply-reduces (_linear), for this CPU.

    Up to there a fused multiply-reduce per row beats aten's product: where MKL runs its tuned code (Intel CPUs) only
    for one row, since its product of 2 rows costs about what one row does; elsewhere inductor's vectorised loops win
    up to about as many rows as the vector width allows (docs/measurements.md has the timings per CPU).
    """
    if _mkl_runs_tuned_code():
        return 1
    return 9 if torch.backends.cpu.get_cpu_capability() == 'AVX512' else 4


def resolve_row_product_max_rows(configured: int) -> int:
    """engine.row_product_max_rows where set (> 0), else ROW_PRODUCT_MAX_ROWS_ENV where set, else this CPU's."""
    if configured > 0:
        return configured
    override = os.environ.get(ROW_PRODUCT_MAX_ROWS_ENV, '')
    if override:
        if not override.isdigit() or int(override) < 1:
            raise ValueError('{} must be a whole number of rows >= 1, got {!r}'.format(ROW_PRODUCT_MAX_ROWS_ENV,
                                                                                      override))
        return int(override)
    return cpu_row_product_max_rows()


# The default of the functions below; a runner passes the engine's resolved value. Read before any step is traced:
# dynamo sees a constant.
ROW_PRODUCT_MAX_ROWS = cpu_row_product_max_rows()


# Longest eager pass (prefill) whose products with a blocked matrix run block by block: short passes gain from reading
# each block once, long ones from aten's product on an unblocked copy (on the bundled target's matrices the two
# cross between 60 and 200 rows).
BLOCKED_BATCH_MAX_ROWS = 128


def _row_product(row: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Return row [in] times weight [out, in] (or blocked) transposed: [out], as a multiply-reduce."""
    if weight.dim() == 3:
        return (weight * row[:, None]).sum(1).flatten()   # [blocks, in, width] summed over in
    return (weight * row).sum(-1)


def _linear(x: torch.Tensor, weight: 'torch.Tensor | QuantizedWeight', bias: torch.Tensor | None = None,
            row_product_max_rows: int = ROW_PRODUCT_MAX_ROWS) -> torch.Tensor:
    """
    Return x [q, in] times weight [out, in] (or blocked: block_matrix) transposed, plus bias: [q, out].

    Compiled for CPU, a pass of up to row_product_max_rows rows is a multiply-reduce per row, which inductor fuses into
    one loop per output (per block of outputs, one vector wide, for a blocked weight): it reads the weight once for
    all rows and converts a 16-bit weight (store_exact_half) on the fly; only the summation order changes. Longer
    passes and eager runs keep aten's product (a 16-bit weight is converted, a blocked one multiplied block by block
    or unblocked, so a step that dynamo runs eager after all, say past its recompile limit, stays correct), which
    inductor's C++ GEMM template generates in graphs compiled on frozen weights (runner: engine.compile
    inductor-gemm). A quantized weight runs its own product (quantize.quantized_linear) in every case.
    """
    if isinstance(weight, QuantizedWeight):
        out = quantized_linear(x, weight)
        return out if bias is None else out + bias
    blocked = weight.dim() == 3
    if _compiling_for_cpu(x) and x.shape[0] <= row_product_max_rows:  # q is static here (steps.query_variant)
        rows = x.as_strided(x.shape, x.stride()).unbind(0)  # a view inductor keeps: x is computed once, not per output
        out = torch.stack([_row_product(row, weight) for row in rows])  # inductor fuses the rows into one loop
        return out if bias is None else out + bias
    if blocked and x.shape[0] > BLOCKED_BATCH_MAX_ROWS:  # a long prefill: one product on an unblocked copy
        weight, blocked = weight.transpose(1, 2).flatten(0, 1), False
    if not blocked:
        return F.linear(x, weight.to(x.dtype), bias)
    out = torch.matmul(x, weight.to(x.dtype)).transpose(0, 1).flatten(1)  # a product per block: [blocks, q, width]
    return out if bias is None else out + bias


def _linears(x: torch.Tensor, weights: tuple, biases: tuple, row_product_max_rows: int) -> list[torch.Tensor]:
    """Return x times each weight plus its bias, as _linear; int8 ones in one call of the CPU op (cheaper)."""
    if int8_together(x, weights):
        outs = cpu_ops.int8_linear(x, tuple(w.data for w in weights), tuple(w.scales for w in weights),
                                   weights[0].tile)
        outs = outs.split([w.data.shape[0] for w in weights], dim=-1)
        return [out if bias is None else out + bias for out, bias in zip(outs, biases, strict=True)]
    return [_linear(x, weight, bias, row_product_max_rows) for weight, bias in zip(weights, biases, strict=True)]


def _feed_forward(x: torch.Tensor, w: _Weights, row_product_max_rows: int) -> torch.Tensor:
    """down(gelu(gate(x)) * up(x)), gelu's tanh form; int8 matrices in one call of the CPU op."""
    if int8_feed_forward_together(x, w.gate_proj, w.up_proj, w.down_proj):
        return cpu_ops.int8_feed_forward(x, w.gate_proj[:2], w.up_proj[:2], w.down_proj[:2], w.gate_proj.tile)
    gate, up = _linears(x, (w.gate_proj, w.up_proj), (None, None), row_product_max_rows)
    return _linear(F.gelu(gate, approximate='tanh') * up, w.down_proj, None, row_product_max_rows)


def _project(shape: _Shape, w: _Weights, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Input norm, query and (producing layers) new keys and values: [q, heads, d], [kv_heads, q, d] x 2."""
    q, rows = hidden.shape[0], shape.row_product_max_rows
    x = _rms_norm(hidden, w.input_norm, shape.eps)
    if w.k_proj is None:
        query, = _linears(x, (w.q_proj,), (w.q_bias,), rows)
    elif w.v_proj is None:
        query, raw_keys = _linears(x, (w.q_proj, w.k_proj), (w.q_bias, w.k_bias), rows)
    else:
        query, raw_keys, values = _linears(x, (w.q_proj, w.k_proj, w.v_proj), (w.q_bias, w.k_bias, w.v_bias), rows)
    query = _rotate(_rms_norm(query.view(q, shape.num_heads, shape.head_dim), w.q_norm, shape.eps), cos, sin)
    if w.k_proj is None:
        return query, None, None
    raw_keys = raw_keys.view(q, shape.num_kv_heads, shape.head_dim)
    values = raw_keys if w.v_proj is None else values.view(q, shape.num_kv_heads, shape.head_dim)
    keys = _rotate(_rms_norm(raw_keys, w.k_norm, shape.eps), cos, sin).transpose(0, 1)
    return query, keys, _rms_norm(values, None, shape.eps).transpose(0, 1)


def _finish(shape: _Shape, w: _Weights, hidden: torch.Tensor, attended: torch.Tensor,
            per_layer_input: torch.Tensor | None) -> torch.Tensor:
    """Output projection, feed-forward and per-layer input of a decoder layer, given the attention output."""
    eps, rows = shape.eps, shape.row_product_max_rows
    hidden = hidden + _rms_norm(_linear(attended, w.o_proj, w.o_bias, rows), w.post_attention_norm, eps)
    x = _rms_norm(hidden, w.pre_feedforward_norm, eps)
    hidden = hidden + _rms_norm(_feed_forward(x, w, rows), w.post_feedforward_norm, eps)
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
    return _finish(shape, w, hidden, _attend(query, keys, values, mask, shape.attention_dtype), per_layer_input)


def _slot_rows(tensor: torch.Tensor, rows: int, per_slot: int, length: int) -> torch.Tensor:
    """Cache keys or values [kv_heads, slots * per_slot, d] as [rows, kv_heads, length, d]: slots 0..rows-1."""
    heads, total, dim = tensor.shape
    return tensor.view(heads, total // per_slot, per_slot, dim)[:, :rows, :length].transpose(0, 1)


def _step_layer_rows(shape: _Shape, w: _Weights, hidden: torch.Tensor, per_layer_input: torch.Tensor | None,
                     cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor, keys: torch.Tensor,
                     values: torch.Tensor, slots: torch.Tensor, per_slot: int) -> torch.Tensor:
    """
    Run one decoder layer of a batched step: B rows of Q tokens, hidden [B * Q, hidden], row b in cache slot b.

    The products run over every row at once (one read of the weights); new K/V are written at slots [B * Q] of the
    cache's keys/values [kv_heads, slots * per_slot, d]; each row then attends to the first L keys of its own slot,
    where mask [B, Q, L].
    """
    query, new_keys, new_values = _project(shape, w, hidden, cos, sin)
    if new_keys is not None:
        keys.index_copy_(1, slots, new_keys)
        values.index_copy_(1, slots, new_values)
    rows, length = mask.shape[0], mask.shape[-1]
    return _finish(shape, w, hidden, _attend_rows(query, _slot_rows(keys, rows, per_slot, length),
                                                  _slot_rows(values, rows, per_slot, length), mask,
                                                  shape.attention_dtype), per_layer_input)


class _Rope:
    """cos/sin per layer type from the model's inverse frequencies, computed as transformers computes them."""

    def __init__(self, rotary_emb, layer_types, dtype: torch.dtype, tensors):  # tensors: weights.FlatTensors
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

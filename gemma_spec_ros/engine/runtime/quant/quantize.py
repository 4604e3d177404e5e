"""
Weight-only quantization of a lean model's matrices and embedding tables (engine.quantization: int8, int4, float16).

A quantized matrix is a QuantizedWeight: integer data plus scales, read by quantized_linear.

- int8: every matrix per output channel (symmetric, 127 levels, float32 scales), as are the embedding tables (per
  row), so a tied embedding and LM head share one QuantizedWeight. On CPU the products round the activations to
  16-bit integers per block of 32 inputs (rounded_activations) and run the engine's own op (cpu_ops.int8_linear;
  several matrices of one input in one call, int8_together), or, where it is not built, a float product over the
  same rounded activations and the converted data. A CPU matrix is stored tile-major where its shape allows
  (int8_tile: CPU_TILE outputs' bytes of each block of 32 inputs together), so the op reads one memory stream per
  tile; embedding() gathers rows from either layout. On CUDA they run a bfloat16 product over the data converted on
  the fly.
- int4: the decoder layers' matrices in groups of INT4_GROUP_SIZE inputs (asymmetric: a scale and a low per group,
  value = level * scale + low, levels 0..15). On CPU they are stored two levels a byte and multiplied by the
  engine's own op over the same 16-bit activation levels as int8 (cpu_ops.int4_linear; where it is not built, a float
  product over the dequantized matrix); on CUDA by aten's weight-only kernel with bfloat16 activations
  (`_weight_int4pack_mm`). The embeddings, the LM head and any matrix whose shape int4 does not take stay int8.
- float16: every matrix and table rounded to float16 and stored so, a plain tensor that the lean forward's products
  convert to the model's dtype as they read it (layers._linear). On CPU with inductor that halves the bytes a
  memory-bound step reads, and the arithmetic stays float32, so nothing else changes.

The quantized model is the target that speculative decoding reproduces exactly: plain decoding and verification
run the same kernels and each row's product is independent of the rows beside it. Rounding activations to
bfloat16 magnifies the last-bit differences of a float32 attention into different products, so int4 models on CUDA
attend in float64 (attention_dtype), whose result does not depend on the pass. The CPU ops' 16-bit levels per block of
32 (int8 and int4) are 256 times finer than bfloat16's rounding, and float16 weights compute in float32: these need no
more than float32 models.
"""

import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ...types import QUANTIZATIONS
from ..ops import cpu_ops

INT8_LEVELS = 127
ACTIVATION_LEVELS = 32767.0  # int16 levels of a block's largest activation (int8 products on CPU)
INT4_GROUP_SIZE = 32
INT4_LEVELS = 15
CUDA_INT4_INNER_K_TILES = 8  # what aten's CUDA int4 packing takes (tinygemm's layout)
CPU_TILE = cpu_ops.OUTPUT_TILE  # outputs a CPU int8 or int4 matrix stores together (the CPU ops' output block)
INT4_MULTIPLES = {'cpu': (CPU_TILE, INT4_GROUP_SIZE), 'cuda': (8, 1024)}  # (out, in) multiples int4 takes
PRODUCT_DTYPE = torch.bfloat16  # activations of aten's int4 products and of CUDA's int8 ones
INTEGER_MODES = ('int8', 'int4')
# what a text model's parameters are called where the lean forward reads them quantized (quantized_kind)
QUANTIZED_MATRICES = ('q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj')
QUANTIZED_TABLES = ('embed_tokens.weight', 'embed_tokens_per_layer.weight', 'per_layer_model_projection.weight')
QUANTIZED_LAYER_TABLES = ('per_layer_input_gate', 'per_layer_projection')


def quantized_kind(name: str) -> str:
    """
    Return how the lean forward stores a text model's parameter, by its name in either class.

    'matrix' (a decoder layer's; int4 in int4 mode), 'table' (int8) or '' (float: norms, scalars, and a
    Gemma4ForConditionalGeneration's vision tower).
    """
    if name == 'lm_head.weight':
        return 'table'
    text_name = name.removeprefix('model.').removeprefix('language_model.')
    if text_name in QUANTIZED_TABLES:
        return 'table'
    parts = text_name.split('.')
    if parts[0] != 'layers' or text_name == name or parts[-1] != 'weight':
        return ''
    return 'matrix' if parts[-2] in QUANTIZED_MATRICES else 'table' if parts[-2] in QUANTIZED_LAYER_TABLES else ''


class QuantizedWeight(NamedTuple):
    """A matrix [out, in] or embedding table [rows, width] stored as integers; a tuple of tensors dynamo traces."""

    data: torch.Tensor     # int8 [out, in] (in tiles of `tile` outputs); int4: its packed layout for the device
    scales: torch.Tensor   # int8: [out] (float32); int4: [in / group, out, 2] scale and zero per group (bfloat16)
    group_size: int        # 0 for int8 (per output channel), else the int4 group
    tile: int = 1          # int8: outputs stored together (int8_tile; 1: row-major)


def int8_tile(shape: tuple[int, int], device: torch.device) -> int:
    """Return the tile an int8 matrix [out, in] is stored in: CPU_TILE on the CPU where it fits, else 1 (row-major)."""
    out_features, in_features = shape
    fits = out_features % CPU_TILE == 0 and in_features % cpu_ops.ACTIVATION_BLOCK == 0
    return CPU_TILE if torch.device(device).type == 'cpu' and fits else 1


def _int8(weight: torch.Tensor, tile: int | None = None) -> QuantizedWeight:
    """
    Quantize weight [out, in] to int8, stored in tiles of `tile` outputs.

    The default is int8_tile of its shape; a block of rows of a larger matrix passes the whole matrix's tile.
    """
    tile = int8_tile(weight.shape, weight.device) if tile is None else tile
    weight = weight.detach().float()
    scales = (weight.abs().amax(dim=1) / INT8_LEVELS).clamp(min=torch.finfo(torch.float32).tiny)
    data = torch.round(weight / scales[:, None]).clamp(-INT8_LEVELS, INT8_LEVELS).to(torch.int8)
    if tile > 1:
        data = _tile_major(data.view(data.shape[0], -1, cpu_ops.ACTIVATION_BLOCK), tile).view(data.shape)
    return QuantizedWeight(data, scales, 0, tile)


def int8_rows(weight: QuantizedWeight) -> torch.Tensor:
    """Return an int8 weight's data row-major [out, in], whatever its tile."""
    data = weight.data
    if weight.tile == 1:
        return data
    blocks = data.view(data.shape[0], -1, cpu_ops.ACTIVATION_BLOCK)
    return _tile_major(blocks, weight.tile, inverse=True).view(data.shape)


# aten's weight-only int4 kernel for CUDA is an underscore op, outside torch's documented API: this module is its only
# user. Without it, int4 mode stores int8 on CUDA.
HAS_CUDA_INT4_KERNEL = all(hasattr(torch.ops.aten, name) for name in ('_convert_weight_to_int4pack',
                                                                      '_weight_int4pack_mm'))


def int4_fits(weight: torch.Tensor) -> bool:
    """Whether int4 takes a matrix of this shape on its device (CPU: whole groups; CUDA: aten's kernel's shapes)."""
    if weight.device.type == 'cuda' and not HAS_CUDA_INT4_KERNEL:
        return False
    out_multiple, in_multiple = INT4_MULTIPLES.get(weight.device.type, (0, 0))
    return bool(out_multiple) and weight.shape[0] % out_multiple == 0 and weight.shape[1] % in_multiple == 0


def _int4(weight: torch.Tensor) -> QuantizedWeight:
    out_features, in_features = weight.shape
    groups = weight.detach().float().view(out_features, in_features // INT4_GROUP_SIZE, INT4_GROUP_SIZE)
    low, high = groups.amin(dim=-1, keepdim=True), groups.amax(dim=-1, keepdim=True)
    scales = ((high - low) / INT4_LEVELS).clamp(min=torch.finfo(torch.float32).tiny)
    if weight.device.type == 'cpu':  # float16 scale and low (a quarter of the bytes of float32 ones), levels from them
        scales = scales.clamp(min=torch.finfo(torch.float16).tiny).to(torch.float16)
        low = low.to(torch.float16)
        levels = torch.round((groups - low.float()) / scales.float()).clamp(0, INT4_LEVELS).to(torch.uint8)
        # byte j of a group: level j (low nibble) and level 16 + j (high nibble); tile-major (_tile_major)
        data = _tile_major(levels[..., :16] | levels[..., 16:] << 4, CPU_TILE).view(out_features, in_features // 2)
        return QuantizedWeight(data, _tile_params(torch.cat((scales, low), dim=-1)), INT4_GROUP_SIZE)
    levels = torch.round((groups - low) / scales).clamp(0, INT4_LEVELS).to(torch.uint8)  # [out, groups, 32]
    # aten's kernel computes (level - 8) * scale + zero, so the zero is the value of level 8
    zeros = low + (INT4_LEVELS + 1) // 2 * scales
    scales_and_zeros = torch.cat((scales, zeros), dim=-1).transpose(0, 1).contiguous().to(PRODUCT_DTYPE)
    levels = levels.view(out_features, -1).to(torch.int32)
    nibbles = (levels[:, ::2] << 4 | levels[:, 1::2]).to(torch.uint8)
    data = torch.ops.aten._convert_weight_to_int4pack(nibbles, CUDA_INT4_INNER_K_TILES)
    return QuantizedWeight(data, scales_and_zeros, INT4_GROUP_SIZE)


def stored_bytes(weight: 'QuantizedWeight | torch.Tensor') -> int:
    """Return the bytes a weight takes as stored: a tensor's, or a QuantizedWeight's data and scales."""
    parts = (weight,) if isinstance(weight, torch.Tensor) else (weight.data, weight.scales)
    return sum(part.numel() * part.element_size() for part in parts)


def _tile_major(values: torch.Tensor, tile: int, inverse: bool = False) -> torch.Tensor:
    """
    Return [out, groups, k] stored tile-major for the CPU ops (inverse: undo it).

    Outputs in tiles of `tile`, and for each tile and group the tile's outputs one after another, so a tile's
    product reads one memory stream instead of one per output. A tile's bytes are its rows' bytes, permuted.
    """
    out_features, groups, width = values.shape
    if inverse:
        return values.reshape(-1, groups, tile, width).transpose(1, 2).reshape(out_features, groups, width)
    return values.view(-1, tile, groups, width).transpose(1, 2).contiguous().view(out_features, groups, width)


def _tile_params(params: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Return CPU int4 params [out, groups, 2] as the op reads them: each tile's scales of a group, then its lows."""
    out_features, groups, _ = params.shape
    if inverse:
        return params.reshape(-1, groups, 2, CPU_TILE).permute(0, 3, 1, 2).reshape(out_features, groups, 2)
    return params.view(-1, CPU_TILE, groups, 2).permute(0, 2, 3, 1).contiguous().view(out_features, groups, 2)


def dequantized_int4(weight: QuantizedWeight) -> torch.Tensor:
    """Return a CPU int4 matrix as float32 [out, in]: level * scale + low (what cpu_ops.int4_linear multiplies by)."""
    out_features = weight.data.shape[0]
    nibbles = _tile_major(weight.data.view(out_features, -1, INT4_GROUP_SIZE // 2), CPU_TILE, inverse=True)
    levels = torch.cat((nibbles & 0x0F, nibbles >> 4), dim=-1).float()  # [out, groups, 32]
    params = _tile_params(weight.scales, inverse=True).float()
    return (levels * params[..., :1] + params[..., 1:]).view(out_features, -1)


def int8_together(x: torch.Tensor, weights: 'tuple[torch.Tensor | QuantizedWeight | None, ...]') -> bool:
    """Whether one cpu_ops.int8_linear call multiplies x by every one of weights (int8, one tile, CPU, built)."""
    return all(isinstance(weight, QuantizedWeight) and not weight.group_size for weight in weights) and \
        len({weight.tile for weight in weights}) == 1 and cpu_ops.int8_linear_usable(x)


def int8_feed_forward_together(x: torch.Tensor, gate, up, down) -> bool:
    """Whether one cpu_ops.int8_feed_forward call runs down(gelu(gate(x)) * up(x)) (int8, CPU, widths of blocks)."""
    return int8_together(x, (gate, up, down)) and down.data.shape[1] % cpu_ops.ACTIVATION_BLOCK == 0


def rounded_activations(x: torch.Tensor) -> torch.Tensor:
    """Return x [q, in] as int8 products on the CPU see it: 16-bit levels per block of ACTIVATION_BLOCK inputs."""
    width = x.shape[-1]
    padding = -width % cpu_ops.ACTIVATION_BLOCK
    blocks = F.pad(x, (0, padding)).view(x.shape[0], -1, cpu_ops.ACTIVATION_BLOCK)
    largest = blocks.abs().amax(dim=-1, keepdim=True)
    inverse = torch.where(largest > 0, ACTIVATION_LEVELS / largest, torch.zeros_like(largest))
    levels = torch.round(blocks * inverse)
    return (levels * (largest / ACTIVATION_LEVELS)).view(x.shape[0], -1)[:, :width]


def quantized_linear(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """Return x [q, in] times the quantized weight [out, in] transposed: [q, out] in x's dtype."""
    if weight.group_size:
        if x.device.type == 'cpu':
            if cpu_ops.int8_linear_usable(x):  # the same rows int8_linear takes
                return cpu_ops.int4_linear(x, (weight.data,), (weight.scales,))
            return F.linear(rounded_activations(x.float()), dequantized_int4(weight)).to(x.dtype)
        out = torch.ops.aten._weight_int4pack_mm(x.to(PRODUCT_DTYPE), weight.data, weight.group_size, weight.scales)
        return out.to(x.dtype)
    if int8_together(x, (weight,)):
        return cpu_ops.int8_linear(x, (weight.data,), (weight.scales,), weight.tile)
    if x.device.type == 'cpu':
        return F.linear(rounded_activations(x), int8_rows(weight).to(x.dtype)) * weight.scales.to(x.dtype)
    return (F.linear(x.to(PRODUCT_DTYPE), weight.data.to(PRODUCT_DTYPE)) * weight.scales).to(x.dtype)


def embedding(input_ids: torch.Tensor, table: 'torch.Tensor | QuantizedWeight', dtype: torch.dtype) -> torch.Tensor:
    """Rows of an embedding table, float (any float dtype) or int8 (per-row scales, either layout), in dtype."""
    if isinstance(table, QuantizedWeight):
        scales = F.embedding(input_ids, table.scales[:, None]).to(dtype)
        if table.tile == 1:
            return F.embedding(input_ids, table.data).to(dtype) * scales
        rows, width = table.data.shape  # row i: tile i // tile, at i % tile in each block of its tile
        tiles = table.data.view(rows // table.tile, width // cpu_ops.ACTIVATION_BLOCK, table.tile, -1)
        data = tiles[input_ids // table.tile, :, input_ids % table.tile]  # [*ids, blocks, 32]
        return data.reshape(*input_ids.shape, width).to(dtype) * scales
    return F.embedding(input_ids, table).to(dtype)


@dataclass
class QuantizationReport:
    """What quantizing one model did: its matrices' bytes before and after, and the time it took."""

    mode: str
    matrices: int = 0
    int4_matrices: int = 0
    bytes_before: int = 0
    bytes_after: int = 0
    seconds: float = 0.0

    def describe(self, role: str) -> str:
        """One line for the load log."""
        int4 = ' ({} int4, the rest int8)'.format(self.int4_matrices) if self.mode == 'int4' else ''
        return '{} quantized to {}: {} matrices{}, {:.1f} -> {:.1f} MiB in {:.2f} s'.format(
            role, self.mode, self.matrices, int4, self.bytes_before / 2 ** 20, self.bytes_after / 2 ** 20,
            self.seconds)


@dataclass
class Quantizer:
    """
    Quantizes a transformers model's parameters once each (a tied embedding and LM head share the result).

    Each quantized parameter's float data is released (an empty tensor), so the model's own forward fails instead
    of running without its weights; only the lean forward runs a quantized model.
    """

    mode: str
    report: QuantizationReport = None
    _done: dict = field(default_factory=dict)

    @classmethod
    def for_mode(cls, mode: str) -> 'Quantizer | None':
        """Return a quantizer for engine.quantization's mode; None for none."""
        return None if mode == 'none' else cls(mode)

    def __post_init__(self):
        if self.mode not in QUANTIZATIONS or self.mode == 'none':
            raise ValueError('Quantizer mode must be one of {}, got {!r}'.format(', '.join(QUANTIZATIONS[1:]),
                                                                                 self.mode))
        self.report = QuantizationReport(self.mode)

    @property
    def quantizes_while_loading(self) -> bool:
        """Whether a load reads the matrices straight into their quantized form (quantized_loading: integer modes)."""
        return self.mode in INTEGER_MODES

    def attention_dtype(self, device: torch.device) -> torch.dtype | None:
        """Return the dtype a quantized model's attention runs in on device (None: the model's; module docstring)."""
        return torch.float64 if self.mode == 'int4' and device.type != 'cpu' else None

    def matrix(self, parameter: torch.Tensor | None) -> 'QuantizedWeight | torch.Tensor | None':
        """Quantize a decoder layer's matrix: int4 where the mode and its shape allow, else int8; or float16."""
        if parameter is None:
            return None
        return self._quantize(parameter, self.mode == 'int4')

    def table(self, parameter: torch.Tensor | None) -> 'QuantizedWeight | torch.Tensor | None':
        """Quantize an embedding table, an LM head or a projection outside the layers: int8 (or float16)."""
        return None if parameter is None else self._quantize(parameter, False)

    def quantize_values(self, values: torch.Tensor, int4_allowed: bool,
                        tile: int | None = None) -> 'QuantizedWeight | torch.Tensor':
        """Quantize a float matrix: int4 where allowed and its shape fits, else int8 (`tile`: _int8's); float16."""
        if self.mode in INTEGER_MODES and values.device.type == 'cpu':
            cpu_ops.ensure_built()  # before the first int8 product (once a process; built once a machine)
        started = time.perf_counter()
        if self.mode == 'float16':
            quantized = values.to(torch.float16)
        else:
            int4 = int4_allowed and self.mode == 'int4' and int4_fits(values)
            quantized = _int4(values) if int4 else _int8(values, tile)
        self.report.seconds += time.perf_counter() - started
        return quantized

    def adopt(self, parameter: torch.Tensor, quantized: 'QuantizedWeight | torch.Tensor', bytes_before: int) -> None:
        """Take quantized as parameter's weight (quantized_loading: the float data was never held)."""
        report = self.report
        report.matrices += 1
        report.int4_matrices += bool(getattr(quantized, 'group_size', 0))
        report.bytes_before += bytes_before
        report.bytes_after += stored_bytes(quantized)
        self._done[id(parameter)] = (parameter, quantized)  # holding the parameter keeps its id unique

    def _quantize(self, parameter: torch.Tensor, int4_allowed: bool) -> 'QuantizedWeight | torch.Tensor':
        if id(parameter) in self._done:
            return self._done[id(parameter)][1]
        quantized = self.quantize_values(parameter.detach(), int4_allowed)
        self.adopt(parameter, quantized, parameter.numel() * parameter.element_size())
        parameter.data = torch.empty(0, dtype=parameter.dtype, device=parameter.device)
        return quantized

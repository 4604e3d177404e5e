"""
Loading a checkpoint straight into quantized weights (engine.quantization int8 or int4), a few rows at a time.

from_pretrained would first hold every float weight: a Gemma 4 E2B checkpoint takes 10 GB in bfloat16, more than an
8 GB Orin has. Here the model is built on the meta device, the buffers its constructor computes (embedding scales,
rope frequencies) are made again on the real device, and each parameter is then read from the safetensors files
with plain reads (no memory map, whose touched pages would count as the process's memory until it closes): the
matrices that the lean forward reads quantized (quantize.quantized_kind) in blocks of
LOAD_ROWS rows, straight into their integer form; the rest (norms, scalars) as they are. At most one block of one
matrix is ever held in float. The Quantizer then hands those quantized weights to the lean model (LeanGemma4).
"""

import json
import re
import struct
from pathlib import Path

import torch
from transformers import GenerationConfig

from ...backend import return_freed_memory
from .quantize import QuantizedWeight, Quantizer, int8_tile, quantized_kind

LOAD_ROWS = 4096  # rows read per block of a large matrix (one block: 4096 x 9 k bfloat16 = 72 MiB for E2B's PLE)
SAFETENSORS_DTYPES = {'F32': torch.float32, 'F16': torch.float16, 'BF16': torch.bfloat16, 'I64': torch.int64,
                      'I32': torch.int32, 'I8': torch.int8, 'U8': torch.uint8, 'BOOL': torch.bool}


class _StoredTensor:
    """Where one tensor of a safetensors file lies: read whole or by rows with plain file reads."""

    def __init__(self, path: Path, start: int, header: dict):
        if header['dtype'] not in SAFETENSORS_DTYPES:
            raise ValueError('{}: tensor dtype {} is not supported'.format(path, header['dtype']))
        self.path, self.dtype, self.shape = path, SAFETENSORS_DTYPES[header['dtype']], tuple(header['shape'])
        self.offset = start + header['data_offsets'][0]
        self.row_bytes = (header['data_offsets'][1] - header['data_offsets'][0]) // max(1, self.shape[0] if
                                                                                         self.shape else 1)

    def rows(self, first: int, end: int) -> torch.Tensor:
        """Rows first..end-1 (the whole tensor for a scalar)."""
        count = end - first if self.shape else 1
        data = bytearray(count * self.row_bytes)
        with open(self.path, 'rb') as stored:
            stored.seek(self.offset + first * self.row_bytes)
            if stored.readinto(data) != len(data):
                raise ValueError('{} is truncated'.format(self.path))
        tensor = torch.frombuffer(data, dtype=self.dtype) if data else torch.empty(0, dtype=self.dtype)
        return tensor.view(count, *self.shape[1:]) if self.shape else tensor.view(())

    def read(self) -> torch.Tensor:
        return self.rows(0, self.shape[0] if self.shape else 1)


def _stored_tensors(directory: Path, key_mapping: dict[str, str] | None) -> dict[str, _StoredTensor]:
    """
    Return every tensor of the checkpoint by its name in the model.

    From the files its shard index names (they may lie in another directory), else from its *.safetensors files;
    key_mapping renames as from_pretrained's does.
    """
    index = directory / 'model.safetensors.index.json'
    if index.is_file():
        paths = sorted({directory / name for name in json.loads(index.read_text())['weight_map'].values()})
    else:
        paths = sorted(directory.glob('*.safetensors'))
    stored = {}
    for path in paths:
        with open(path, 'rb') as file:
            (length,) = struct.unpack('<Q', file.read(8))
            header = json.loads(file.read(length))
        for name, entry in header.items():
            if name == '__metadata__':
                continue
            for pattern, replacement in (key_mapping or {}).items():
                name = re.sub(pattern, replacement, name)
            stored[name] = _StoredTensor(path, 8 + length, entry)
    return stored


def _remake_computed_buffers(model, device: torch.device) -> None:
    """
    Make the buffers the constructor computed (not stored in checkpoints) again on device, with their values.

    Each module is initialised by its nearest enclosing PreTrainedModel, as from_pretrained does: an assistant's
    text model computes its rope and embedding scale from its own config, not the assistant's.
    """
    owners = {name: module for name, module in model.named_modules() if hasattr(module, '_init_weights')}
    for name, module in model.named_modules():
        if module._non_persistent_buffers_set:
            for buffer in module._non_persistent_buffers_set:
                module._buffers[buffer] = torch.empty_like(module._buffers[buffer], device=device)
            owner = max((prefix for prefix in owners if not prefix or name == prefix or name.startswith(prefix + '.')),
                        key=len)
            owners[owner]._init_weights(module)  # its parameters are still on meta: only the buffers get values


def load_quantized(model_class, config, directory: Path, device: torch.device, dtype: torch.dtype,
                   quantizer: Quantizer, key_mapping: dict[str, str] | None = None):
    """Build model_class(config) from directory with the lean forward's matrices quantized as they are read."""
    with torch.device('meta'):
        model = model_class(config)
    _remake_computed_buffers(model, device)
    stored = _stored_tensors(directory, key_mapping)
    for name, _ in list(model.named_parameters()):
        if name not in stored:
            continue  # tied to a stored one (the LM head to the embedding), tied again below
        module_name, _, attribute = name.rpartition('.')
        module = model.get_submodule(module_name)
        kind = quantized_kind(name)
        if kind:
            quantized = _quantize_rows(stored[name], kind, quantizer, device)
            return_freed_memory()  # the blocks' float copies: glibc otherwise keeps their heap (E2B: +3 GB peak)
            replacement = torch.nn.Parameter(torch.empty(0, dtype=dtype, device=device), requires_grad=False)
            quantizer.adopt(replacement, quantized, _numel(stored[name].shape) * torch.finfo(dtype).bits // 8)
        else:
            replacement = torch.nn.Parameter(stored[name].read().to(device, dtype), requires_grad=False)
        setattr(module, attribute, replacement)
    for name, buffer in model.named_buffers():
        if buffer.device.type == 'meta':
            if name not in stored:
                raise ValueError('{} has no tensor {} (a checkpoint of another architecture?)'.format(directory, name))
            module_name, _, attribute = name.rpartition('.')
            model.get_submodule(module_name)._buffers[attribute] = stored[name].read().to(device, buffer.dtype)
    if getattr(config.get_text_config(), 'tie_word_embeddings', False):
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    if (directory / 'generation_config.json').is_file():
        model.generation_config = GenerationConfig.from_pretrained(str(directory), local_files_only=True)
    missing = [name for name, parameter in model.named_parameters() if parameter.device.type == 'meta']
    if missing:
        raise ValueError('{} lacks {} of the model\'s weights: {}'.format(directory, len(missing),
                                                                          ', '.join(missing[:5])))
    return model.eval()


def _numel(shape: tuple) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _quantize_rows(stored: _StoredTensor, kind: str, quantizer: Quantizer, device: torch.device) -> QuantizedWeight:
    """Quantize a stored matrix block by block (whole where int4 packs it)."""
    rows = stored.shape[0]
    if kind == 'matrix' and quantizer.mode == 'int4':
        return quantizer.quantize_values(stored.read().to(device, torch.float32), True)
    data, scales = None, None
    tile = int8_tile(stored.shape, device)  # the whole matrix's: LOAD_ROWS is a multiple of any tile
    for first in range(0, rows, LOAD_ROWS):  # into the result as they come: joining the blocks would hold it twice
        end = min(rows, first + LOAD_ROWS)
        block = quantizer.quantize_values(stored.rows(first, end).to(device, torch.float32), False, tile)
        if data is None:
            data = torch.empty((rows, *block.data.shape[1:]), dtype=block.data.dtype, device=device)
            scales = torch.empty(rows, dtype=block.scales.dtype, device=device)
        data[first:end], scales[first:end] = block.data, block.scales
    return QuantizedWeight(data, scales, 0, tile)

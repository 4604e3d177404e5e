"""
An EAGLE-3 draft head: one decoder layer fed by the target's low, middle and high hidden states.

Positions are the target's. The head's entry at position p reads the token x_p (the target's scaled embedding) and
a feature of the position before it:
- a *true* entry takes the target's states at p - 1 (LeanGemma4.feature_layers' outputs and the final-norm state,
  StepOutput.features), fused to the head's width;
- a *drafted* entry takes the head's own output at p - 1 instead (the head's layer output is its feature).

The output at p predicts x_{p+1}. The head keeps its own K/V of every entry; drafting k tokens enters k positions,
the first true and the rest drafted, and a round rolls the drafted ones back and enters the accepted tokens as true
ones. Training (train/eagle3.py) runs every depth of drafted entries at once, each query seeing exactly the keys it
would see here (training_masks): what EAGLE-3 calls training-time test.

The head's architecture and checkpoint format are this package's (``eagle3.json`` and ``model.safetensors``): neither
vLLM nor llama.cpp documents an EAGLE-3 format for Gemma 4 heads.
"""

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from .layers import ROW_PRODUCT_MAX_ROWS, _linear

CONFIG_NAME = 'eagle3.json'
WEIGHTS_NAME = 'model.safetensors'


@dataclass(frozen=True)
class Eagle3Config:
    """The head's shape, and the target it belongs to."""

    target_hidden_size: int
    target_num_layers: int
    feature_layers: tuple[int, int]   # the target layers tapped for the low and middle states (0-based)
    vocab_size: int
    hidden_size: int = 192
    intermediate_size: int = 2048
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0

    def __post_init__(self):
        low, middle = self.feature_layers
        if not 0 <= low < middle < self.target_num_layers - 1:
            raise ValueError('EAGLE-3 feature_layers must be two target layers, low < middle < the last ({}), '
                             'got {}'.format(self.target_num_layers - 1, self.feature_layers))
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError('EAGLE-3 num_attention_heads must be a multiple of num_key_value_heads')

    @classmethod
    def for_target(cls, target_config, **shape) -> 'Eagle3Config':
        """Return the shape for a target's text config: low and middle taps at a sixth and a half of its depth."""
        layers = target_config.num_hidden_layers
        return cls(target_config.hidden_size, layers, (max(0, layers // 6), max(1, layers // 2 - 1)),
                   target_config.vocab_size, **shape)


class _RmsNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # a drafting step is a few small ops: no conversions where none are needed
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()).to(x.dtype)


class Eagle3Head(nn.Module):
    """The head's weights and its arithmetic; the K/V it keeps at inference is an Eagle3Cache."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.config = config
        width, target, eps = config.hidden_size, config.target_hidden_size, config.rms_norm_eps
        self.tap_norms = nn.ModuleList(_RmsNorm(target, eps) for _ in range(3))  # low, middle, final-norm high
        self.fuse = nn.Linear(3 * target, width, bias=False)
        self.embed_norm = _RmsNorm(target, eps)
        self.feature_norm = _RmsNorm(width, eps)
        self.pre = nn.Linear(target + width, width, bias=False)
        heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.attn_norm = _RmsNorm(width, eps)
        self.q_proj = nn.Linear(width, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(width, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(width, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, width, bias=False)
        self.mlp_norm = _RmsNorm(width, eps)
        self.gate_proj = nn.Linear(width, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(width, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, width, bias=False)
        self.final_norm = _RmsNorm(width, eps)
        self.lm_head = nn.Linear(width, config.vocab_size, bias=False)
        inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
        self.register_buffer('inv_freq', inv_freq, persistent=False)
        self._packed: tuple[torch.Tensor, torch.Tensor] | None = None  # frozen: (q|k|v, gate|up) in one matrix each
        self.row_product_max_rows = ROW_PRODUCT_MAX_ROWS  # the engine's: compiled passes this short are row products

    def train(self, mode: bool = True) -> 'Eagle3Head':
        self._packed = None
        return super().train(mode)

    def _matrices(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the q|k|v and gate|up matrices, each one product; kept once the head is frozen (drafting)."""
        if self._packed is not None:
            return self._packed
        packed = (torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]),
                  torch.cat([self.gate_proj.weight, self.up_proj.weight]))
        if not self.training and not self.q_proj.weight.requires_grad:
            self._packed = tuple(matrix.detach() for matrix in packed)
        return packed

    # ------------------------------------------------------------------------------------------- the arithmetic
    def _product(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """X [..., in] times weight [out, in] transposed, as the lean forward multiplies (compiled: row products)."""
        return _linear(x.reshape(-1, x.shape[-1]), weight, None, self.row_product_max_rows).view(*x.shape[:-1], -1)

    def fuse_target(self, features: torch.Tensor) -> torch.Tensor:
        """Target states [..., 3 * target_hidden] (StepOutput.features) -> the head's feature [..., hidden]."""
        parts = features.split(self.config.target_hidden_size, dim=-1)
        return self._product(torch.cat([norm(part) for norm, part in zip(self.tap_norms, parts, strict=True)], dim=-1),
                             self.fuse.weight)

    def project(self, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor):
        """
        Entries' inputs -> (residual [B, T, hidden], query [B, heads, T, d], key and value [B, kv_heads, T, d]).

        embeds [B, T, target_hidden] are the tokens' scaled target embeddings, features [B, T, hidden] the features
        of the positions before them, positions [T].
        """
        x = self._product(torch.cat([self.embed_norm(embeds), self.feature_norm(features)], dim=-1), self.pre.weight)
        h = self.attn_norm(x)
        batch, length, _ = h.shape
        config = self.config
        head_dim, kv_width = config.head_dim, config.num_key_value_heads * config.head_dim
        query, key, value = self._product(h, self._matrices()[0]).split(
            [config.num_attention_heads * head_dim, kv_width, kv_width], dim=-1)
        query = query.view(batch, length, -1, head_dim).transpose(1, 2)
        key = key.view(batch, length, -1, head_dim).transpose(1, 2)
        value = value.view(batch, length, -1, head_dim).transpose(1, 2)
        angles = positions.float()[:, None] * self.inv_freq[None, :]
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos().to(h.dtype), angles.sin().to(h.dtype)
        return x, _rotate(query, cos, sin), _rotate(key, cos, sin), value

    def finish(self, x: torch.Tensor, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               mask: torch.Tensor) -> torch.Tensor:
        """Attention over keys/values [B, kv_heads, S, d] where mask [T, S] (or [B, 1, T, S]) allows, then the MLP."""
        attended = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, enable_gqa=True)
        x = x + self._product(attended.transpose(1, 2).flatten(2), self.o_proj.weight)
        gate, up = self._product(self.mlp_norm(x), self._matrices()[1]).chunk(2, dim=-1)
        return x + self._product(F.gelu(gate, approximate='tanh') * up, self.down_proj.weight)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Map the head's output [..., hidden] to logits [..., vocab]."""
        return self._product(self.final_norm(hidden), self.lm_head.weight)

    # ------------------------------------------------------------------------------------------- the checkpoint
    def save(self, directory: str | Path, dtype: torch.dtype = torch.float16) -> None:
        """Write eagle3.json and model.safetensors (weights stored as dtype; they load as the engine's dtype)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / CONFIG_NAME).write_text(json.dumps({'architecture': 'Eagle3Head', **asdict(self.config)},
                                                        indent=2) + '\n')
        save_file({name: tensor.detach().to(dtype).contiguous() for name, tensor in self.state_dict().items()},
                  str(directory / WEIGHTS_NAME))

    @classmethod
    def load(cls, directory: str | Path, device: torch.device, dtype: torch.dtype) -> 'Eagle3Head':
        """Read a head written by save; ValueError naming the directory and what is missing."""
        directory = Path(directory)
        if not (directory / CONFIG_NAME).is_file() or not (directory / WEIGHTS_NAME).is_file():
            raise ValueError('EAGLE-3 head directory {} needs {} and {}'.format(directory, CONFIG_NAME, WEIGHTS_NAME))
        fields = json.loads((directory / CONFIG_NAME).read_text())
        if fields.pop('architecture', None) != 'Eagle3Head':
            raise ValueError('{} in {} is not an Eagle3Head config'.format(CONFIG_NAME, directory))
        fields['feature_layers'] = tuple(fields['feature_layers'])
        head = cls(Eagle3Config(**fields))
        weights = load_file(str(directory / WEIGHTS_NAME))
        head.load_state_dict({name: tensor.float() for name, tensor in weights.items()})
        return head.to(device=device, dtype=dtype).eval().requires_grad_(False)

    def check_fits(self, target_config, directory: str) -> None:
        """ValueError unless the head was made for a target of this shape."""
        config = self.config
        mine = (config.target_hidden_size, config.target_num_layers, config.vocab_size)
        theirs = (target_config.hidden_size, target_config.num_hidden_layers, target_config.vocab_size)
        if mine != theirs:
            raise ValueError('EAGLE-3 head {} is for a target of hidden size, layers and vocabulary {}; the target has '
                             '{}'.format(directory, mine, theirs))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def training_masks(length: int, depth: int, device) -> torch.Tensor:
    """
    Bool [length, (depth + 1) * length]: what a query of drafted depth `depth` at entry i sees (True: attend).

    Entries 0..length-1 of each depth are the window's positions in order. A query of depth s at entry i drafts
    after a chain that started with the true entry i - s: it sees the true entries up to i - s (the keys of depth 0)
    and, of each depth d in 1..s, the chain's entry i - s + d, which is what the cache holds at inference.
    """
    query = torch.arange(length, device=device)[:, None]
    key = torch.arange(length, device=device)[None, :]
    blocks = [key <= query - depth] + [key == query - depth + d for d in range(1, depth + 1)]
    return torch.cat(blocks, dim=1)


class Eagle3Cache:
    """
    The head's K/V at inference: its entries at consecutive positions from `start`, rolled back by crop.

    Eager and dynamic: the head is one layer, and its entries per call (a round's catch-up, then one per draft) vary.
    """

    def __init__(self, head: Eagle3Head, capacity: int, device: torch.device, dtype: torch.dtype):
        config = head.config
        shape = (1, config.num_key_value_heads, capacity, config.head_dim)
        self.head = head
        self.keys = torch.zeros(shape, device=device, dtype=dtype)
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        self.capacity = capacity
        self.start = 0    # position of the first entry
        self.length = 0   # entries held

    @property
    def nbytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()

    @property
    def end(self) -> int:
        """The position the next entry takes."""
        return self.start + self.length

    def reset(self, start: int) -> None:
        """Forget every entry; the next goes at position start."""
        self.start, self.length = start, 0

    def crop(self, end: int) -> None:
        """Keep the entries before position end."""
        self.length = max(0, min(self.length, end - self.start))

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the tensors a compiled step writes (a shadow's are rebound to these)."""
        return self.keys, self.values

    def inputs(self, count: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Check that count more entries fit; return their positions and slots [count] (enter_entries)."""
        if self.length + count > self.capacity:
            raise ValueError('the EAGLE-3 head holds {} entries; {} more do not fit'.format(self.capacity, count))
        offsets = torch.arange(count, device=device)
        return self.end + offsets, self.length + offsets

    def enter(self, embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """Enter the next embeds [1, q, target_hidden] with features [1, q, hidden] eager; return [1, q, hidden]."""
        positions, slots = self.inputs(embeds.shape[1], embeds.device)
        kv_slots = torch.arange(self.length + embeds.shape[1], device=embeds.device)
        hidden, _ = enter_entries(self.head, self.keys, self.values, embeds, features, positions, slots, kv_slots)
        self.length += embeds.shape[1]
        return hidden


def enter_entries(head: Eagle3Head, keys: torch.Tensor, values: torch.Tensor, embeds: torch.Tensor,
                  features: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                  kv_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """
    Write entries' K/V at slots [q] of keys/values and run them: their outputs [1, q, hidden] and last logits [1, V].

    kv_slots [n] = 0..n-1, n past the last slot written: the slots read (static shapes but n, compiled or eager).
    """
    x, query, key, value = head.project(embeds, features, positions)
    keys.index_copy_(2, slots, key)
    values.index_copy_(2, slots, value)
    seen = kv_slots[None, :] <= slots[:, None]
    length = kv_slots.shape[0]
    hidden = head.finish(x, query, keys[:, :, :length], values[:, :, :length], seen)
    return hidden, head.logits(hidden[0, -1:])

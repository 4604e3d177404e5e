"""Model shapes for the bundled target, draft model and MTP assistant."""

from dataclasses import dataclass

import torch
from transformers import Gemma4AssistantConfig, Gemma4TextConfig

from gemma_spec_ros.train.tokenizer import END_OF_TURN_ID

HEAD_DIM = 64          # sliding layers; the assistant must match the target's head dims and KV heads
GLOBAL_HEAD_DIM = 128  # full-attention layers


@dataclass(frozen=True)
class ModelShape:
    """The knobs that matter for a small Gemma 4 text model."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int = 4
    num_kv_heads: int = 2
    sliding_window: int = 128
    full_every: int = 3          # every n-th layer uses full attention (the last one always does)

    def __post_init__(self):
        if min(self.num_layers, self.hidden_size, self.intermediate_size, self.num_heads, self.num_kv_heads) < 1:
            raise ValueError(f'model shape sizes must be positive: {self}')
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f'num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})')

    @classmethod
    def parse(cls, text: str, **overrides) -> 'ModelShape':
        """'LAYERSxHIDDENxINTERMEDIATE', e.g. '8x256x1024'."""
        try:
            layers, hidden, intermediate = (int(part) for part in text.lower().split('x'))
        except ValueError:
            raise ValueError(f"shape must look like 'LAYERSxHIDDENxINTERMEDIATE' (e.g. 8x256x1024), "
                             f'got {text!r}') from None
        return cls(layers, hidden, intermediate, **overrides)

    def layer_types(self) -> list[str]:
        return ['full_attention' if (i + 1) % self.full_every == 0 or i == self.num_layers - 1
                else 'sliding_attention' for i in range(self.num_layers)]


def text_config(shape: ModelShape, vocab_size: int, **extra) -> Gemma4TextConfig:
    """Build a text-only Gemma 4 config (no per-layer inputs, no MoE) with the tokenizer's special ids."""
    return Gemma4TextConfig(
        vocab_size=vocab_size, hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads, head_dim=HEAD_DIM, global_head_dim=GLOBAL_HEAD_DIM,
        sliding_window=shape.sliding_window, layer_types=shape.layer_types(),
        hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, max_position_embeddings=8192,
        pad_token_id=0, eos_token_id=[1, END_OF_TURN_ID], bos_token_id=2, tie_word_embeddings=True, **extra)


def assistant_config(target: Gemma4TextConfig, shape: ModelShape) -> Gemma4AssistantConfig:
    """Build an MTP assistant config for target: same vocabulary, head dims and KV heads; no per-layer inputs."""
    layers = {kind: target.per_layer_config[target.layer_types.index(kind)] for kind in set(target.layer_types)}
    if set(layers) != {'full_attention', 'sliding_attention'}:
        raise ValueError('the target must have both sliding and full attention layers for the assistant to read')
    sliding, full = layers['sliding_attention'], layers['full_attention']
    text = Gemma4TextConfig(
        vocab_size=target.vocab_size, hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_heads,
        num_key_value_heads=sliding.num_key_value_heads, num_global_key_value_heads=full.num_key_value_heads,
        head_dim=sliding.head_dim,
        global_head_dim=full.head_dim, sliding_window=target.sliding_window,
        layer_types=shape.layer_types(), hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
        num_kv_shared_layers=shape.num_layers, max_position_embeddings=target.max_position_embeddings,
        pad_token_id=target.pad_token_id, eos_token_id=target.eos_token_id, bos_token_id=target.bos_token_id,
        attention_k_eq_v=getattr(target, 'attention_k_eq_v', False), rope_parameters=target.rope_parameters)
    return Gemma4AssistantConfig(text_config=text, backbone_hidden_size=target.hidden_size)


def parameter_count(model: torch.nn.Module) -> int:
    """Count unique parameters (tied embeddings once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())

"""
A Gemma 4 causal LM (the target or the draft model) with its KV cache, behind one interface for both paths.

- ``FastCausalLM`` (runner.py): the lean forward on a static cache, eager, compiled or captured.
- ``DynamicCausalLM`` (here): transformers' own forward on a DynamicCache, for engine.compile transformers and for
  models the lean forward does not cover (MoE).

Both: ``reset()`` per request, ``prefill(ids, logits_to_keep, want_states)`` for the prompt, ``append(...)`` for a
step, ``crop(-n)`` to roll back, ``length``, ``nbytes`` (the preallocated cache), ``mode``, ``warmup()`` and
``graph_jobs()`` (a background warm-up's, warmup.py).
"""

from collections.abc import Callable

import torch
from transformers import DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPooling

from ..model.forward import StepOutput
from ..model.layers import ROW_PRODUCT_MAX_ROWS
from ..model.vision import SoftTokens
from ..quant.quantize import Quantizer
from .runner import FastCausalLM, WarmupReport

NO_MASKS = {'full_attention': None, 'sliding_attention': None}


def single_token_masks(token_ids: torch.Tensor) -> dict | None:
    """
    Attention masks for a pass over token_ids [1, q]: none needed for one token, else built by the model.

    A single query may see every cached key: full layers hold only the past, and a rolled-back sliding layer hands
    out exactly its window. Mask construction is a noticeable share of a small model's decode step.
    """
    return NO_MASKS if token_ids.shape[1] == 1 else None


class DynamicCausalLM:
    """transformers' forward on a DynamicCache; rolled-back sliding K/V is kept until the next crop."""

    mode = 'transformers'
    nbytes = 0  # the cache grows with the context instead of being preallocated

    def __init__(self, model):
        self.model = model
        self.reset()

    def reset(self) -> None:
        """Start a new request with an empty cache."""
        self._cache = DynamicCache(config=self.model.config)
        self._cache.activate_past_recording()  # sliding layers keep rolled-back K/V until the next crop
        self.length = 0

    def prefill_prompt(self, input_ids: torch.Tensor, prefix_cache=None, logits_to_keep: int = 1,
                       want_states: bool = False, soft: SoftTokens | None = None, image_keys=None
                       ) -> tuple[StepOutput, int]:
        """Start a request with its prompt (runner.FastCausalLM.prefill_prompt's call); no prefix cache here."""
        self.reset()
        return self.prefill(input_ids, logits_to_keep, want_states, soft), 0

    def prefill(self, input_ids: torch.Tensor, logits_to_keep: int = 1, want_states: bool = False,
                soft: SoftTokens | None = None) -> StepOutput:
        """
        Append input_ids [1, n] (the prompt); logits (and states) of the last logits_to_keep positions.

        soft: an image goal's image embeddings (vision.py), which Gemma4Model merges at their token's positions (its
        mask lets an image's tokens see each other where the model says so).
        """
        images = {} if soft is None else {
            'mm_encoder_outputs': {'image': BaseModelOutputWithPooling(pooler_output=(soft.features,))},
            'mm_token_type_ids': (input_ids == soft.token_id).long()}
        out = self.append(input_ids, logits_to_keep, want_states, **images)
        self._cache.crop(0)
        return out

    def append(self, input_ids: torch.Tensor, logits_to_keep: int = 0, want_states: bool = False,
               **images) -> StepOutput:
        """
        Append input_ids [1, q] at the cache end; logits of the last logits_to_keep positions (0: all).

        want_states: also the final hidden states (of the kept positions) and the shared K/V the MTP assistant reads.
        images: a prefill's image inputs to transformers' forward.
        """
        q = input_ids.shape[1]
        positions = torch.arange(self.length, self.length + q, device=input_ids.device).unsqueeze(0)
        extra = {'output_hidden_states': -1, 'return_shared_kv_states': True} if want_states else {}
        out = self.model(input_ids=input_ids, position_ids=positions, cache=self._cache, use_cache=True,
                         logits_to_keep=logits_to_keep, attention_mask=single_token_masks(input_ids), **extra,
                         **images)
        self.length += q
        if not want_states:
            return StepOutput(out.logits, None)
        hidden = out.hidden_states[-1]
        return StepOutput(out.logits, hidden[:, -logits_to_keep:] if logits_to_keep else hidden,
                          out.shared_kv_states)

    def crop(self, tokens_to_remove: int) -> None:
        """Roll back: drop the last -tokens_to_remove tokens (0 still ends the recorded past of sliding layers)."""
        self._cache.crop(tokens_to_remove)
        self.length += tokens_to_remove

    def warmup(self, logits_to_keep: int = 0, progress: Callable[[str], None] | None = None) -> WarmupReport:
        """Nothing to compile."""
        return WarmupReport(self.mode, 0, 0.0)

    def graph_jobs(self, role: str, logits_to_keep: int = 0) -> list:
        """Nothing to compile."""
        return []


def build_causal_lm(model, compile_mode: str, context_limit: int, max_query: int, role: str,
                    progress: Callable[[str], None], quantizer: Quantizer | None = None,
                    row_product_max_rows: int = ROW_PRODUCT_MAX_ROWS) -> 'FastCausalLM | DynamicCausalLM':
    """
    Build the runner engine.compile asks for: transformers' forward for 'transformers', else the fast path.

    With auto, a model the lean forward does not cover (it raises ValueError saying why) runs transformers' forward,
    and progress says so; with an explicit mode, or with a quantizer (only the lean forward reads quantized
    weights), that is an error. quantizer: the model's (quantize.py; the load may have quantized part already),
    logged. row_product_max_rows: engine.row_product_max_rows, resolved (FastCausalLM).
    """
    if compile_mode == 'transformers':
        return DynamicCausalLM(model)
    try:
        runner = FastCausalLM(model, context_limit, max_query, compile_mode, quantizer, row_product_max_rows)
    except ValueError as exc:
        if compile_mode != 'auto' or quantizer is not None:
            quantized = '' if quantizer is None else ' (engine.quantization={})'.format(quantizer.mode)
            raise ValueError('engine.compile={}{} cannot run the {}: {}'.format(compile_mode, quantized, role,
                                                                              exc)) from exc
        progress("{}: fast path not available ({}); running transformers' forward".format(role, exc))
        return DynamicCausalLM(model)
    if runner.quantization is not None:
        progress(runner.quantization.describe(role))
    return runner


def parameter_bytes(model) -> int:
    """Bytes of a model's parameters and buffers."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors)


def weights_bytes(runner: 'FastCausalLM | DynamicCausalLM') -> int:
    """Bytes of a runner's weights: its model's parameters and buffers, quantized matrices at their stored size."""
    quantization = getattr(runner, 'quantization', None)  # a quantized parameter's own data is released
    return parameter_bytes(runner.model) + (0 if quantization is None else quantization.bytes_after)

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

This module holds the lean models (LeanGemma4, LeanAssistant) and the pass that runs their layers (_Decoder);
layers.py the arithmetic of one layer, weights.py the loading of the weights into flat buffers.
"""

from dataclasses import dataclass, field

import torch

from ..quant.quantize import Quantizer, embedding
from .cache import EMPTY_POSITION, FULL, SLIDING, KvLayerSpec, SlottedKvCache, StaticKvCache
from .layers import (
    ROW_PRODUCT_MAX_ROWS,
    _attend,
    _compiling_for_cpu,
    _finish,
    _linear,
    _project,
    _rms_norm,
    _Rope,
    _step_layer,
    _step_layer_rows,
)
from .vision import SoftTokens, image_blocks
from .weights import FlatTensors, _Layer, _layer_parts, _stored, _text_parts


@dataclass
class StepOutput:
    """What a lean pass returns, for the last n positions it was asked to keep."""

    logits: torch.Tensor          # [1, n, vocab] (final softcapping applied)
    hidden: torch.Tensor | None   # [1, n, hidden] final-norm hidden states (what the MTP assistant reads)
    shared_kv_states: dict | None = None  # transformers' forward only: {layer_type: (keys, values)} for its assistant
    greedy_row: torch.Tensor | None = None  # [n + 2] a fast verify pass's greedy verify() of its tokens after the
    #                                         first as drafts: accepted count, the n - 1 drafts, -1, next token
    features: torch.Tensor | None = None  # [1, fed, (taps + 1) * hidden] every fed position's residual stream after
    #                                       each of LeanGemma4.feature_layers and its final-norm state (EAGLE-3)


# A layer is compiled once per layer shape and reused (hierarchical compilation), which keeps the compile time
# independent of the depth. Compiled for CPU, a model of at most INLINE_MAX_LAYERS layers inlines them into one graph
# instead: inductor then writes the graph's wrapper in C++ (steps.py: cpp_wrapper, which cannot call a nested region),
# and a step runs its kernels without Python between them, which makes a step faster (the bundled 12-layer target's
# plain step by about an eighth) at the price of a longer cold compile (about 1.8x). Deeper models (Gemma-4-E2B: 35
# layers) keep the regions: their compile time would grow with the depth.
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
    taps: list[torch.Tensor] = field(default_factory=list)  # the hidden after each of _Decoder.feature_layers


class _Decoder:
    """Decoder layers shared by the causal LM and the assistant."""

    layers: list[_Layer]
    tensors: FlatTensors
    feature_layers: tuple[int, ...] = ()  # layers whose output a pass taps (StepOutput.features; set before warm-up)

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
                state.taps += [hidden] if index in self.feature_layers else []
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
            hidden = _finish(layer.shape, weights, hidden, _attend(query, keys, values, state.masks[kind],
                                                                   layer.shape.attention_dtype),
                             per_layer_input)
            state.taps += [hidden] if index in self.feature_layers else []
        return hidden

    def _layers_rows(self, hidden: torch.Tensor, cache: SlottedKvCache, positions: torch.Tensor,
                     rope: dict[str, tuple[torch.Tensor, torch.Tensor]], masks: dict[str, torch.Tensor],
                     per_layer: torch.Tensor | None) -> torch.Tensor:
        """Run the layers of a batched step: hidden [B * Q, hidden] at positions [B, Q], row b in cache slot b."""
        slots = {kind: cache.write_slots(kind, positions) for kind in (FULL, SLIDING)}
        for index, layer in enumerate(self.layers):
            kind = layer.shape.layer_type
            cos, sin = rope[kind]
            hidden = _step_layer_rows(layer.shape, self.tensors.each(layer.weights), hidden,
                                      None if per_layer is None else per_layer[:, index], cos, sin, masks[kind],
                                      cache.keys[layer.kv_index], cache.values[layer.kv_index], slots[kind],
                                      cache.slot_len(kind))
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

    def __init__(self, model, row_product_max_rows: int = ROW_PRODUCT_MAX_ROWS, blocked: bool = False,
                 quantizer: Quantizer | None = None):
        """
        Read the model's weights; pack them where every compiled step is one graph (_packs_weights).

        row_product_max_rows: the longest compiled CPU pass whose products are multiply-reduces (_linear).
        blocked: store the layers' matrices blocked (block_matrix) where the weights are packed.
        quantizer: quantize the matrices and embedding tables (quantize.py); their float data is released.
        """
        table = (lambda tensor: tensor) if quantizer is None else quantizer.table
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
        self._embed = tensors.add(table(weight))
        self._embed_scale = tensors.add(text_model.embed_tokens.embed_scale.to(self.dtype))
        self._lm_head = tensors.add(table(lm_head.weight))  # tied: the embedding's handle (quantized once)
        self._final_norm = tensors.add(text_model.norm.weight)
        self.hidden_size = config.hidden_size
        # multimodal placeholder ids are replaced by pad before embedding, as Gemma4Model does
        self.placeholder_ids = [] if multimodal is None else [
            getattr(multimodal, name) for name in ('image_token_id', 'video_token_id', 'audio_token_id')
            if getattr(multimodal, name, None) is not None]
        self.pad_token_id = config.pad_token_id
        # 'vision': an image's tokens see each other in sliding layers (at the prefill of an image goal)
        self.image_runs_bidirectional = getattr(config, 'use_bidirectional_attention', None) == 'vision'
        self.per_layer_size = config.hidden_size_per_layer_input
        if self.per_layer_size:
            self._per_layer_embed = tensors.add(table(text_model.embed_tokens_per_layer.weight))
            self._per_layer_embed_scale = tensors.add(text_model.embed_tokens_per_layer.embed_scale.to(self.dtype))
            self._per_layer_model_projection = tensors.add(table(text_model.per_layer_model_projection.weight))
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
                                            row_product_max_rows, blocked, quantizer))
        self.rope = _Rope(text_model.rotary_emb, config.layer_types, self.dtype, tensors)
        if self._packs_weights(self.device):
            tensors.pack()

    def new_cache(self, context_limit: int, max_query: int) -> StaticKvCache:
        """Make a static cache for this model: context_limit tokens, steps of up to max_query tokens."""
        return StaticKvCache(self.kv_specs, context_limit, self.sliding_window, max_query, self.device, self.dtype)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Scaled token embedding [..., hidden] (what the MTP assistant's input starts with)."""
        return embedding(input_ids, self.embed, self.dtype) * self.embed_scale

    def _inputs(self, input_ids: torch.Tensor,
                soft: SoftTokens | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """
        input_ids [q] -> embeddings [q, hidden] and per-layer inputs [q, layers, per_layer] (or None).

        soft (an image goal's prefill): its features replace the embeddings at its token's positions, as Gemma4Model
        merges them, so the per-layer inputs' context part reads them too (their token part reads pad there).
        """
        images = None if soft is None else (input_ids == soft.token_id)[:, None]
        for placeholder in self.placeholder_ids:
            input_ids = torch.where(input_ids == placeholder, self.pad_token_id, input_ids)
        embeds = self.embed_tokens(input_ids)
        if images is not None:
            embeds = embeds.masked_scatter(images, soft.features)
        if not self.per_layer_size:
            return embeds, None
        q = input_ids.shape[0]
        token_part = (embedding(input_ids, self.per_layer_embed, self.dtype) * self.per_layer_embed_scale).view(
            q, len(self.layers), self.per_layer_size)
        context_part = (_linear(embeds, self.per_layer_model_projection, None, self.row_product_max_rows)
                        * self.per_layer_projection_scale)
        context_part = _rms_norm(context_part.view(q, len(self.layers), self.per_layer_size),
                                 self.per_layer_projection_norm, self.eps)
        return embeds, (context_part + token_part) * self.per_layer_input_scale

    def _head(self, hidden: torch.Tensor, state: _Pass | None = None, logits_to_keep: int = 0) -> StepOutput:
        """Logits and final-norm states of the last logits_to_keep of hidden (0: all); features from state's taps."""
        normed = _rms_norm(hidden[-logits_to_keep:], self.final_norm, self.eps)
        logits = _linear(normed, self.lm_head, None, self.row_product_max_rows)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        features = None
        if state is not None and self.feature_layers:  # every fed position's (a verify pass keeps all: normed once)
            everywhere = normed if normed.shape[0] == hidden.shape[0] else _rms_norm(hidden, self.final_norm, self.eps)
            features = torch.cat([*state.taps, everywhere], dim=-1).unsqueeze(0)
        return StepOutput(logits.unsqueeze(0), normed.unsqueeze(0), features=features)

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
        state = _Pass(cache, positions, self.rope.at(positions), masks, kv_len)
        hidden = self._layers(hidden, state, per_layer)
        return self._head(hidden, state, logits_to_keep)

    def new_slotted_cache(self, num_slots: int, context_limit: int, max_query: int) -> SlottedKvCache:
        """Make a cache of num_slots sequences for batched steps (step_rows)."""
        return SlottedKvCache(self.kv_specs, num_slots, context_limit, self.sliding_window, max_query, self.device,
                              self.dtype)

    def step_rows(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: SlottedKvCache, kv_len: int,
                  logits_to_keep: int) -> StepOutput:
        """
        One static-shape batched pass: row b's tokens input_ids[b] [Q] at positions[b] (consecutive) in cache slot b.

        Like step, per row: full layers attend over the slot's first kv_len positions, sliding layers over its ring.
        Returns logits [B, logits_to_keep, vocab] and hidden states of each row's last logits_to_keep positions.
        The caller records each row's write in its slot (``cache.slots[b].advance``).
        """
        rows, width = input_ids.shape
        hidden, per_layer = self._inputs(input_ids.flatten())
        cache.ring_positions.index_copy_(0, cache.write_slots(SLIDING, positions), positions.flatten())
        query_positions = positions[:, :, None]                               # [B, Q, 1]
        ring = cache.ring_view(rows)[:, None, :]                             # [B, 1, ring]
        masks = {FULL: cache.key_positions[None, None, :kv_len] <= query_positions,
                 SLIDING: (ring <= query_positions) & (ring > query_positions - self.sliding_window)}
        hidden = self._layers_rows(hidden, cache, positions, self.rope.at(positions.flatten()), masks, per_layer)
        kept = hidden.view(rows, width, -1)[:, -logits_to_keep:].flatten(0, 1)
        out = self._head(kept)
        return StepOutput(out.logits.view(rows, logits_to_keep, -1), out.hidden.view(rows, logits_to_keep, -1))

    def prefill(self, input_ids: torch.Tensor, cache: StaticKvCache, start: int, logits_to_keep: int,
                soft: SoftTokens | None = None) -> StepOutput:
        """
        Any number of tokens [1, n] at positions start.. (eager, dynamic shapes): the prompt, or a long extension.

        Sliding layers attend over [ring entries before start, new keys]; the last ring_size new keys are written
        into the ring after the pass. Records the write in the cache. soft: the images' embeddings (_inputs).
        """
        count = input_ids.shape[1]
        cache.check_write(start, count)
        positions = torch.arange(start, start + count, device=self.device)
        hidden, per_layer = self._inputs(input_ids[0], soft)
        query_positions = positions[:, None]
        old_ring = cache.ring_positions
        old_ring = torch.where(old_ring < start, old_ring, torch.full_like(old_ring, EMPTY_POSITION))
        sliding_keys = torch.cat((old_ring, positions))[None, :]
        seen = sliding_keys <= query_positions
        if soft is not None and self.image_runs_bidirectional:
            seen = seen | image_blocks(input_ids[0], soft.token_id, cache.ring_size)
        masks = {FULL: cache.key_positions[None, :start + count] <= query_positions,
                 SLIDING: seen & (sliding_keys > query_positions - self.sliding_window)}
        state = _Pass(cache, positions, self.rope.at(positions), masks, start + count, pending={})
        hidden = self._layers(hidden, state, per_layer)
        kept = positions[-cache.ring_size:]
        slots = kept % cache.ring_size
        for kv_index, (new_keys, new_values) in state.pending.items():
            cache.keys[kv_index].index_copy_(1, slots, new_keys[:, -cache.ring_size:])
            cache.values[kv_index].index_copy_(1, slots, new_values[:, -cache.ring_size:])
        cache.ring_positions.index_copy_(0, slots, kept)
        cache.advance(start, count)
        return self._head(hidden, state, logits_to_keep)


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

    def __init__(self, assistant, target: LeanGemma4, quantizer: Quantizer | None = None,
                 row_product_max_rows: int = ROW_PRODUCT_MAX_ROWS):
        """quantizer: its layers' matrices and LM head (projections stay float); row products: the engine's."""
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
        self.row_product_max_rows = rows = row_product_max_rows
        self.tensors = tensors = FlatTensors()
        self.layers = []
        for index, layer in enumerate(text_model.layers[:config.num_hidden_layers]):
            attn = layer.self_attn
            if attn.layer_type not in producers:
                raise ValueError('MTP assistant layer {} reads {} K/V, which the target does not produce'.format(
                    index, attn.layer_type))
            parts = _layer_parts(layer, producers[attn.layer_type], config.num_attention_heads, self.eps, tensors,
                                 rows, quantizer=quantizer)
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
        self.vocab_size = config.vocab_size  # not the head's shape: a quantized load leaves that empty
        self._lm_head = tensors.add(assistant.lm_head.weight if quantizer is None else
                                    quantizer.table(assistant.lm_head.weight))
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
        x = self._product(inputs, self.pre_projection)
        before = position[:, None] - 1
        ring = cache.ring_positions[None, :]
        masks = {FULL: cache.key_positions[None, :kv_len] <= before,
                 SLIDING: (ring <= before) & (ring >= before - self.sliding_window)}
        x = self._layers(x, _Pass(cache, position, self.rope.at(position), masks, kv_len), None)
        x = _rms_norm(x, self.final_norm, self.eps)
        logits = self._ordered_logits(x) if self.ordered else self._product(x, self.lm_head)
        return StepOutput(logits.unsqueeze(0), self._product(x, self.post_projection).unsqueeze(0))

    def step_rows(self, token_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                  cache: SlottedKvCache, kv_len: int) -> StepOutput:
        """
        Run one draft step for each row: row b drafts from the target's K/V in slot b of a slotted cache.

        token_ids [B, 1], hidden [B, 1, backbone] and positions [B, 1] as in step, per row. Returns logits
        [B, 1, vocab] and the projected hidden [B, 1, backbone]. kv_len > every position bounds the keys read.
        """
        inputs = torch.cat((self.target.embed_tokens(token_ids[:, 0]), hidden[:, 0]), dim=-1)  # [B, 2 * backbone]
        x = self._product(inputs, self.pre_projection)
        before = positions[:, :, None] - 1                                                     # [B, 1, 1]
        ring = cache.ring_view(token_ids.shape[0])[:, None, :]                                 # [B, 1, ring]
        masks = {FULL: cache.key_positions[None, None, :kv_len] <= before,
                 SLIDING: (ring <= before) & (ring >= before - self.sliding_window)}
        x = self._layers_rows(x, cache, positions, self.rope.at(positions.flatten()), masks, None)
        x = _rms_norm(x, self.final_norm, self.eps)
        logits = self._ordered_logits_rows(x) if self.ordered else self._product(x, self.lm_head)
        return StepOutput(logits[:, None], self._product(x, self.post_projection)[:, None])

    def _ordered_logits_rows(self, x: torch.Tensor) -> torch.Tensor:
        """_ordered_logits for each row of x [B, hidden] -> [B, vocab]."""
        top = torch.topk(self._product(x, self.centroids), k=self.top_k, dim=-1).indices               # [B, top_k]
        clusters = self.token_ordering.long().view(self.num_centroids, -1)
        selected = clusters[top].flatten(1)                                                      # [B, top_k * per]
        selected_logits = torch.bmm(self._head_rows(selected, x.dtype).to(x.dtype), x[:, :, None])[:, :, 0]
        floor = selected_logits.min(dim=-1, keepdim=True).values - 1.0
        return floor.expand(x.shape[0], self.vocab_size).clone().scatter_(-1, selected, selected_logits)

    def _ordered_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Logits [1, vocab] from x [1, hidden]: exact for the tokens of the top centroids, the rest below their min."""
        top = torch.topk(self._product(x, self.centroids), k=self.top_k, dim=-1).indices                # [1, top_k]
        clusters = self.token_ordering.long().view(self.num_centroids, -1)
        selected = clusters[top].reshape(1, -1)                                                  # [1, top_k * per]
        selected_logits = self._product(x, self._head_rows(selected[0], x.dtype))  # [1, top_k * per]
        floor = selected_logits.min() - 1.0
        return floor.expand(1, self.vocab_size).clone().scatter_(-1, selected, selected_logits)

    def _product(self, x: torch.Tensor, weight) -> torch.Tensor:
        """Return x times weight transposed, with the engine's row products (_linear)."""
        return _linear(x, weight, None, self.row_product_max_rows)

    def _head_rows(self, selected: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Return the LM head's rows of the selected tokens in dtype (an int8 head's: its rows times their scales)."""
        return embedding(selected, self.lm_head, dtype)

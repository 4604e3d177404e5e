"""Loading the models from local directories and checking that they fit together."""

from dataclasses import dataclass
from pathlib import Path

import torch

from ...conversation.format import RESPONSE_OPEN, TURN_CLOSE
from ...types import DEVICES, DTYPES
from ..quant.loading import load_quantized
from ..quant.quantize import Quantizer

TARGET_TYPES = ('gemma4_text', 'gemma4')  # text-only Gemma4ForCausalLM, multimodal Gemma4ForConditionalGeneration
ASSISTANT_TYPE = 'gemma4_assistant'
TORCH_DTYPES = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}
# A Gemma4ForCausalLM checkpoint's text weight names to Gemma4ForConditionalGeneration's: the bundled vision model's
# shard index takes its text weights from the bundled target's file; a real Gemma 4 checkpoint has none to rename
SHARED_TEXT_KEY_MAPPING = {r'^model\.(?=(?:embed_tokens|layers|norm)\.)': 'model.language_model.'}
# Gemma4Config's multimodal tokens: the placeholders the encoders' outputs replace, and the markers around them
PLACEHOLDER_FIELDS = ('image_token_id', 'video_token_id', 'audio_token_id')
MULTIMODAL_TOKEN_FIELDS = PLACEHOLDER_FIELDS + ('boi_token_id', 'eoi_token_id', 'boa_token_id', 'eoa_token_index')


@dataclass(frozen=True)
class AttentionShape:
    """What a KV consumer must agree on with the producer, per attention type."""

    head_dim: int
    num_kv_heads: int


def resolve_device(name: str) -> torch.device:
    """auto|cpu|cuda -> torch.device (auto picks cuda when available)."""
    if name == 'auto':
        return torch.device('cuda' if torch.cuda.is_available() else 'cpu')
    if name not in DEVICES and not name.startswith('cuda:'):
        raise ValueError('engine.device must be {} or {}, got {!r}'.format(', '.join(DEVICES[:-1]), DEVICES[-1], name))
    if name.startswith('cuda') and not torch.cuda.is_available():
        raise ValueError('engine.device is {!r} but CUDA is not available on this machine'.format(name))
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto|float32|bfloat16|float16 -> torch.dtype (auto: float32 on CPU, bfloat16 on CUDA)."""
    if name == 'auto':
        return torch.bfloat16 if device.type == 'cuda' else torch.float32
    if name not in TORCH_DTYPES:
        raise ValueError('engine.dtype must be one of {}, got {!r}'.format(', '.join(DTYPES), name))
    return TORCH_DTYPES[name]


def check_model_dir(path: str, role: str) -> Path:
    """Make sure path holds a config and safetensors weights; pickle .bin checkpoints are refused."""
    if not path:
        raise ValueError('no directory given for the {}'.format(role))
    directory = Path(path)
    if not directory.is_dir():
        raise ValueError('{} directory {} does not exist'.format(role, directory))
    if not (directory / 'config.json').is_file():
        raise ValueError('{} directory {} has no config.json'.format(role, directory))
    if not any(directory.glob('*.safetensors')):
        if any(directory.glob('*.bin')) or any(directory.glob('*.pt')) or any(directory.glob('*.pth')):
            raise ValueError(
                '{} directory {} holds pickle weights (.bin/.pt), which are refused because loading them can run '
                'arbitrary code; convert the checkpoint to safetensors (save_pretrained(..., '
                'safe_serialization=True))'.format(role, directory))
        raise ValueError('{} directory {} has no .safetensors weights'.format(role, directory))
    return directory


def _read_config(directory: Path, role: str):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(directory), trust_remote_code=False, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError('cannot read the {} config in {}: {}'.format(role, directory, exc)) from exc


def _from_pretrained(model_class, directory: Path, role: str, device: torch.device, dtype: torch.dtype,
                     quantizer: Quantizer | None = None, **options):
    try:
        if quantizer is not None and quantizer.quantizes_while_loading:  # never holds every float weight at once
            return load_quantized(model_class, _read_config(directory, role), directory, device, dtype, quantizer,
                                  options.get('key_mapping'))
        model = model_class.from_pretrained(str(directory), dtype=dtype, use_safetensors=True,
                                            trust_remote_code=False, local_files_only=True, **options)
    except Exception as exc:  # corrupt or truncated weights surface as many error types
        raise ValueError('cannot load the {} from {}: {}: {}'.format(role, directory, type(exc).__name__, exc)) \
            from exc
    model = model.to(device).eval()
    _own_buffers(model)
    return model


def _own_buffers(model) -> None:
    """
    Give every buffer memory of its own.

    A buffer stored in the dtype it loads in (the MTP assistant's int64 token ordering) is a view of safetensors'
    memory map of the checkpoint, which then stays mapped and resident whole: 4.4 MiB for the bundled assistant
    after its matrices were copied to float32. Buffers are small; a parameter that stays a view is the weights.
    """
    copies = {}  # a buffer two modules share stays shared
    for module in model.modules():
        for name, buffer in module.named_buffers(recurse=False):
            if id(buffer) not in copies:
                copies[id(buffer)] = buffer.clone()
            setattr(module, name, copies[id(buffer)])  # stays a buffer, persistent or not as it was


def load_causal_lm(path: str, role: str, device: torch.device, dtype: torch.dtype, quantizer: Quantizer | None = None):
    """
    Load a Gemma 4 language model: Gemma4ForCausalLM, or Gemma4ForConditionalGeneration.

    A Gemma4ForConditionalGeneration keeps its vision tower and embedder (vision.VisionTower reads images with
    them); its text model is what the engine decodes with. quantizer: read the matrices the lean forward quantizes
    straight into their quantized form (quantized_loading).
    """
    from transformers import Gemma4ForCausalLM, Gemma4ForConditionalGeneration

    directory = check_model_dir(path, role)
    config = _read_config(directory, role)
    if config.model_type == 'gemma4_text':
        return _from_pretrained(Gemma4ForCausalLM, directory, role, device, dtype, quantizer)
    if config.model_type == 'gemma4':
        return _from_pretrained(Gemma4ForConditionalGeneration, directory, role, device, dtype, quantizer,
                                key_mapping=SHARED_TEXT_KEY_MAPPING)
    raise ValueError('{} at {} is a {!r} model ({}); expected a Gemma 4 language model ({})'.format(
        role, directory, config.model_type, ', '.join(config.architectures or []), ' or '.join(TARGET_TYPES)))


def load_assistant(path: str, device: torch.device, dtype: torch.dtype, quantizer: Quantizer | None = None):
    """Load a Gemma4AssistantForCausalLM (the MTP drafter); quantizer as load_causal_lm's."""
    from transformers import Gemma4AssistantForCausalLM

    directory = check_model_dir(path, 'MTP assistant')
    config = _read_config(directory, 'MTP assistant')
    if config.model_type != ASSISTANT_TYPE:
        raise ValueError('MTP assistant at {} is a {!r} model; expected {!r} (Gemma4AssistantForCausalLM)'.format(
            directory, config.model_type, ASSISTANT_TYPE))
    return _from_pretrained(Gemma4AssistantForCausalLM, directory, 'MTP assistant', device, dtype, quantizer)


def load_tokenizer(path: str):
    """Load the tokenizer stored next to the model."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=False, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError('cannot load a tokenizer from {}: {}'.format(path, exc)) from exc


def text_config(model):
    """Return the decoder (text) config of a Gemma 4 model of either class."""
    return model.config.get_text_config(decoder=True)


def context_limit(config, model) -> int:
    """Most tokens of one request: engine.context_limit, at most the model's max_position_embeddings."""
    return min(config.context_limit, text_config(model).max_position_embeddings)


def decoder_layers(model):
    """Return the text decoder layers of Gemma4ForCausalLM, Gemma4ForConditionalGeneration or the assistant."""
    inner = model.model
    return inner.language_model.layers if hasattr(inner, 'language_model') else inner.layers


def _producer_shapes(target) -> dict[str, AttentionShape]:
    """Shape of the K/V the target hands out per attention type (from its last KV-producing layer of that type)."""
    shapes = {}
    for layer in decoder_layers(target):
        attention = layer.self_attn
        if attention.is_kv_shared_layer:
            continue
        kv_heads = attention.k_proj.out_features // attention.head_dim
        shapes[attention.layer_type] = AttentionShape(attention.head_dim, kv_heads)
    return shapes


def check_same_vocab(target, target_tokenizer, drafter, drafter_path: str, role: str) -> None:
    """Check that the drafter uses the target's tokenizer and vocabulary size."""
    target_vocab, drafter_vocab = text_config(target).vocab_size, text_config(drafter).vocab_size
    if target_vocab != drafter_vocab:
        raise ValueError('{} at {} has vocab_size {} but the target has {}; target and drafter must share the '
                         'tokenizer and vocabulary'.format(role, drafter_path, drafter_vocab, target_vocab))
    directory = Path(drafter_path)
    if not any((directory / name).is_file() for name in ('tokenizer.json', 'tokenizer.model')):
        return
    drafter_tokenizer = load_tokenizer(drafter_path)
    differing = set(drafter_tokenizer.get_vocab().items()) ^ set(target_tokenizer.get_vocab().items())
    # a multimodal target names its image and audio tokens where a text tokenizer has other tokens at those ids
    if {token_id for _, token_id in differing} - multimodal_token_ids(target):
        raise ValueError('{} at {} ships a tokenizer that differs from the target tokenizer; target and drafter '
                         'must share the tokenizer'.format(role, drafter_path))


def multimodal_token_ids(model) -> set[int]:
    """Return the ids of a Gemma4ForConditionalGeneration's multimodal tokens (MULTIMODAL_TOKEN_FIELDS)."""
    values = (getattr(model.config, name, None) for name in MULTIMODAL_TOKEN_FIELDS)
    return {value for value in values if value is not None} if model.config.model_type == 'gemma4' else set()


def placeholder_ids(model) -> frozenset[int]:
    """Return the ids whose positions take an encoder's output in a Gemma4ForConditionalGeneration (image, ...)."""
    values = (getattr(model.config, name, None) for name in PLACEHOLDER_FIELDS)
    return frozenset(value for value in values if value is not None) if model.config.model_type == 'gemma4' \
        else frozenset()


def check_assistant_fits(target, assistant, assistant_path: str) -> None:
    """Check that the assistant can read the target's hidden state and K/V (widths, head dims, KV heads)."""
    target_hidden = text_config(target).hidden_size
    if assistant.config.backbone_hidden_size != target_hidden:
        raise ValueError('MTP assistant at {} has backbone_hidden_size {} but the target hidden_size is {}; this '
                         'assistant was trained for another target'.format(
                             assistant_path, assistant.config.backbone_hidden_size, target_hidden))
    produced = _producer_shapes(target)
    for index, layer in enumerate(decoder_layers(assistant)):
        attention = layer.self_attn
        kv_heads = attention.config.num_attention_heads // attention.num_key_value_groups
        wanted = AttentionShape(attention.head_dim, kv_heads)
        have = produced.get(attention.layer_type)
        if have is None:
            raise ValueError('MTP assistant at {} layer {} reads {} K/V, which the target does not produce'.format(
                assistant_path, index, attention.layer_type))
        if have != wanted:
            raise ValueError('MTP assistant at {} layer {} ({}) expects head_dim {} and {} KV heads but the target '
                             'provides head_dim {} and {} KV heads'.format(
                                 assistant_path, index, attention.layer_type, wanted.head_dim, wanted.num_kv_heads,
                                 have.head_dim, have.num_kv_heads))
    if assistant.config.use_ordered_embeddings:
        ordering = assistant.masked_embedding.token_ordering
        expected = torch.arange(ordering.numel(), device=ordering.device)
        if not torch.equal(ordering.long().sort().values, expected):
            raise ValueError('MTP assistant at {} uses ordered embeddings but its token_ordering buffer is not a '
                             'permutation of the vocabulary (unset?)'.format(assistant_path))


def eos_token_ids(target, tokenizer) -> set[int]:
    """
    Return the ids that end generation: generation config EOS, the tokenizer's EOS, and turn ends.

    A model turn ends at Gemma 4's <turn|> or <|tool_response> (after tool calls), or Gemma 3's <end_of_turn>.
    """
    eos = target.generation_config.eos_token_id
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    vocab, special = tokenizer.get_vocab(), set(tokenizer.all_special_tokens)
    ids.update(vocab[token] for token in (TURN_CLOSE, RESPONSE_OPEN, '<end_of_turn>')
               if token in vocab and token in special)
    return ids

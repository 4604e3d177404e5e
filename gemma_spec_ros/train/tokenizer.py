"""
Byte-level BPE tokenizer with Gemma's special-token ids, Gemma 4's control tokens and its chat format.

Gemma 4's control tokens take ids that ordinary text never uses, so that every model trained on the tokenizer
keeps its embedding table: the byte tokens of the bytes that never occur in UTF-8 (0xC0, 0xC1, 0xF5-0xFF) and,
past those, the ids of the last BPE merges (the rarest pieces; text that held them now takes two tokens).
"""

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from gemma_spec_ros.engine.logits.grammar import byte_level_chars

# Ids match Gemma4TextConfig defaults: pad 0, eos 1, bos 2; a turn opens at 4 and closes at 5.
SPECIAL_TOKENS = ['<pad>', '<eos>', '<bos>', '<unk>', '<|turn>', '<turn|>']
END_OF_TURN_ID = SPECIAL_TOKENS.index('<turn|>')
_OLD_NAMES = {'<start_of_turn>': '<|turn>', '<end_of_turn>': '<turn|>'}   # the Gemma 3 names of ids 4 and 5
# Gemma 4's multimodal tokens, on invalid-UTF-8 bytes (the ids the vision model was trained with).
MULTIMODAL_TOKENS = {'boi_token': ('<|image>', 0xF9), 'eoi_token': ('<image|>', 0xFA),
                     'image_token': ('<|image|>', 0xFB), 'boa_token': ('<|audio>', 0xFC),
                     'eoa_token': ('<audio|>', 0xFD), 'audio_token': ('<|audio|>', 0xFE),
                     'video_token': ('<|video|>', 0xFF)}
# The conversation's control tokens: six more invalid-UTF-8 bytes, then the last merges.
CONTROL_TOKENS = ('<|"|>', '<|tool_call>', '<tool_call|>', '<|tool_response>', '<tool_response|>', '<|channel>',
                  '<channel|>', '<|think>', '<|tool>', '<tool|>')
_FREE_BYTES = (0xC0, 0xC1, 0xF5, 0xF6, 0xF7, 0xF8)
# A reply ends at <turn|> or <eos>, or at <|tool_response> after its tool calls (the caller runs them).
STOP_TOKENS = ('<eos>', '<turn|>', '<|tool_response>')

# Gemma 4's chat format. format_argument writes a value as Gemma 4 does (strings between <|"|> tokens, bare keys).
# A system turn opens when there is a system message, tools or thinking; <|think> switches thinking on. An
# assistant message's tool calls, and the tool messages that answer them, stay in one model turn, which goes on
# after the last tool message (no new model turn). Earlier thoughts are not shown again.
CHAT_TEMPLATE = (Path(__file__).parent / 'chat_template.jinja').read_text()

# transformers' parse_response: a reply's thoughts, tool calls and answer (the text after the model turn's last
# opening or tool response).
RESPONSE_TEMPLATE = {
    'version': 1,
    'start_anchor': ['<|turn>model\n', '<tool_response|>'],
    'fields': {
        'thinking': {'open_pattern': r'<\|channel>(?:thought\n)?', 'close': '<channel|>', 'content': 'text',
                     'content_args': {'strip': False}},
        'tool_calls': {'open_pattern': r'<\|tool_call>call:(?P<name>[A-Za-z_][A-Za-z0-9_.\-]*)',
                       'close': '<tool_call|>', 'content': 'json', 'repeats': True,
                       'content_args': {'unquoted_keys': True, 'string_delims': [['<|"|>', '<|"|>']]},
                       'transform': {'type': 'function', 'function': {'name': '{name}', 'arguments': '{content}'}}},
        'content': {'close': ['<turn|>', '<|tool_response>', '<eos>'], 'content': 'text'},
    },
}


def train_tokenizer(texts: Iterable[str], vocab_size: int, min_frequency: int = 2) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on texts with Gemma 4's control tokens; encoding adds <bos> like Gemma's tokenizer."""
    if vocab_size < 256 + len(SPECIAL_TOKENS) + len(_FREE_BYTES) + len(CONTROL_TOKENS) + 1:
        raise ValueError(f'vocab_size must exceed the 256 byte tokens plus specials, got {vocab_size}')
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=True)
    core.train_from_iterator(texts, trainer=trainer)
    bos_id = core.token_to_id('<bos>')
    core.post_processor = processors.TemplateProcessing(
        single='<bos> $A', pair='<bos> $A $B', special_tokens=[('<bos>', bos_id)])
    return with_gemma4_tokens(json.loads(core.to_str()))


def with_gemma4_tokens(core: dict) -> PreTrainedTokenizerFast:
    """
    Return a trained byte-level BPE (tokenizer.json as a dict) with Gemma 4's tokens and chat format.

    Ids 4 and 5 become <|turn> and <turn|> (Gemma 3 called them <start_of_turn> and <end_of_turn>); the image,
    audio and control tokens take ids that text never uses (module docstring). Idempotent.
    """
    vocab, merges = core['model']['vocab'], core['model']['merges']
    added = {token['id']: token for token in core['added_tokens']}
    for token in added.values():
        if token['content'] in _OLD_NAMES:
            vocab[_OLD_NAMES[token['content']]] = vocab.pop(token['content'])
            token['content'] = _OLD_NAMES[token['content']]
    byte_chars = byte_level_chars()
    present = {token['content'] for token in added.values()}
    wanted = [(content, byte) for content, byte in MULTIMODAL_TOKENS.values()] + \
        list(zip(CONTROL_TOKENS, _FREE_BYTES + (None,) * (len(CONTROL_TOKENS) - len(_FREE_BYTES)), strict=True))
    for content, byte in wanted:
        if content in present:
            continue
        if byte is not None:
            token_id = vocab.pop(byte_chars[byte])
        else:  # the rarest merge: nothing merges its result further, so dropping it leaves a valid BPE
            left, right = merges.pop()
            token_id = vocab.pop(left + right)
        vocab[content] = token_id
        added[token_id] = {'id': token_id, 'content': content, 'single_word': False, 'lstrip': False,
                           'rstrip': False, 'normalized': False, 'special': True}
    core['added_tokens'] = [added[index] for index in sorted(added)]
    extra = ['<|turn>', '<turn|>', *CONTROL_TOKENS]
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(core, ensure_ascii=False)), pad_token='<pad>',
        eos_token='<eos>', bos_token='<bos>', unk_token='<unk>', chat_template=CHAT_TEMPLATE,
        model_max_length=131072, extra_special_tokens=extra,
        **{name: content for name, (content, _) in MULTIMODAL_TOKENS.items()})
    tokenizer.response_template = RESPONSE_TEMPLATE
    return tokenizer


def convert_tokenizer(tokenizer_dir: Path, out_dir: Path) -> PreTrainedTokenizerFast:
    """Write tokenizer_dir's tokenizer into out_dir in Gemma 4's format (with_gemma4_tokens)."""
    core = json.loads((Path(tokenizer_dir) / 'tokenizer.json').read_text())
    tokenizer = with_gemma4_tokens(core)
    save_tokenizer(tokenizer, Path(out_dir))
    return tokenizer


def bytes_per_token(tokenizer: PreTrainedTokenizerFast, texts: Iterable[str]) -> float:
    """Compression on texts (higher is better), counting UTF-8 bytes per token without <bos>."""
    num_bytes = num_tokens = 0
    for text in texts:
        num_bytes += len(text.encode())
        num_tokens += len(tokenizer(text, add_special_tokens=False)['input_ids'])
    return num_bytes / max(num_tokens, 1)


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out_dir)

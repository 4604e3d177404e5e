"""Byte-level BPE tokenizer with Gemma's special-token ids and a Gemma-style chat template."""

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

# Ids match Gemma4TextConfig defaults: pad 0, eos 1, bos 2.
SPECIAL_TOKENS = ['<pad>', '<eos>', '<bos>', '<unk>', '<start_of_turn>', '<end_of_turn>']
END_OF_TURN_ID = SPECIAL_TOKENS.index('<end_of_turn>')

CHAT_TEMPLATE = (
    '{{ bos_token }}'
    '{% for message in messages %}'
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<start_of_turn>{{ role }}\n{{ message['content'] | trim }}<end_of_turn>\n"
    '{% endfor %}'
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int, min_frequency: int = 2) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on texts; encoding adds <bos> like Gemma's tokenizer."""
    if vocab_size < 256 + len(SPECIAL_TOKENS) + 1:
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
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token='<pad>', eos_token='<eos>', bos_token='<bos>', unk_token='<unk>',
        additional_special_tokens=['<start_of_turn>', '<end_of_turn>'], chat_template=CHAT_TEMPLATE,
        model_max_length=131072)


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

"""
Cost of grammar-constrained decoding on the CPU: compile time per schema and mask time per token.

Run with ``python -m gemma_spec_ros bench grammar-timing [--tokenizer DIR] [--repeats N]``. Vocabularies: the
given tokenizer (default: the bundled 4,096-token one) and a synthetic one of Gemma's size (262,144 pieces of
Python source: words with their leading space and their prefixes, punctuation runs, every printable byte).
Figures are medians over repeats; torch and xgrammar use one thread.
"""

import argparse
import json
import re
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import xgrammar
from tokenizers import Tokenizer, models
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from gemma_spec_ros.engine.config_file import resolve_model_path
from gemma_spec_ros.engine.logits.grammar import JSON_SCHEMA, ConstraintCompiler

GEMMA_VOCAB = 262_144
DRAFT_TOKENS = 4
STEP = {'type': 'object', 'properties': {'action': {'enum': ['navigate', 'pick', 'place']},
                                         'target': {'type': 'string'}}, 'required': ['action', 'target']}
POINT = {'type': 'object', 'properties': {axis: {'type': 'number'} for axis in 'xyz'}, 'required': ['x', 'y', 'z']}
# (name, schema, a valid instance whose tokens drive the masks)
CASES = [
    ('plan', {'type': 'object', 'properties': {'steps': {'type': 'array', 'items': STEP, 'minItems': 1,
                                                          'maxItems': 8}}, 'required': ['steps']},
     {'steps': [{'action': 'navigate', 'target': 'kitchen table'}, {'action': 'pick', 'target': 'red cup'},
                {'action': 'navigate', 'target': 'sink'}, {'action': 'place', 'target': 'drying rack'}]}),
    ('pose', {'type': 'object', 'properties': {'frame': {'enum': ['map', 'odom']}, 'position': POINT,
                                               'yaw': {'type': 'number', 'minimum': -3.15, 'maximum': 3.15}},
              'required': ['frame', 'position', 'yaw']},
     {'frame': 'map', 'position': {'x': 1.25, 'y': -0.5, 'z': 0.0}, 'yaw': 1.57}),
    ('skill_call', {'type': 'object', 'properties': {
        'skill': {'const': 'move_arm'}, 'args': {'type': 'object', 'properties': {'joints': {
            'type': 'array', 'items': {'type': 'number', 'minimum': -3.2, 'maximum': 3.2}, 'minItems': 6,
            'maxItems': 6}, 'speed': {'type': 'number'}}, 'required': ['joints']}}, 'required': ['skill', 'args']},
     {'skill': 'move_arm', 'args': {'joints': [0.1, -1.2, 1.5, 0.0, 0.7, -0.3], 'speed': 0.5}}),
    ('report', {'type': 'object', 'properties': {
        'status': {'enum': ['ok', 'blocked', 'failed']}, 'summary': {'type': 'string', 'maxLength': 200},
        'objects': {'type': 'array', 'items': {'type': 'object', 'properties': {
            'label': {'type': 'string', 'pattern': '^[a-z_]+$'}, 'confidence': {'type': 'number', 'minimum': 0,
                                                                                'maximum': 1}},
            'required': ['label', 'confidence']}, 'maxItems': 10}}, 'required': ['status', 'summary']},
     {'status': 'blocked', 'summary': 'A chair stands in the doorway; I need another route to the lab.',
      'objects': [{'label': 'chair', 'confidence': 0.93}, {'label': 'door_frame', 'confidence': 0.71}]}),
]


def synthetic_vocab_tokenizer(size: int) -> PreTrainedTokenizerFast:
    """Build a word-level tokenizer of every printable byte and the most frequent stdlib source pieces and prefixes."""
    counts: Counter = Counter()
    for path in sorted(Path(json.__file__).parents[1].rglob('*.py')):
        if 'site-packages' not in path.parts:
            counts.update(re.findall(r' ?\w+| ?[^\w\s]+|\s+', path.read_text(errors='ignore')))
        if len(counts) > 2 * size:
            break
    for piece, count in list(counts.items()):  # BPE vocabularies also hold the prefixes merges pass through
        for end in range(2, len(piece)):
            counts[piece[:end]] += count
    pieces = ['<pad>', '<eos>'] + [chr(byte) for byte in range(32, 127)] + ['\n', '\t']
    seen = set(pieces)
    pieces += [piece for piece, _ in counts.most_common() if piece not in seen][:size - len(pieces)]
    backend = Tokenizer(models.WordLevel({piece: index for index, piece in enumerate(pieces)}, unk_token='<pad>'))
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token='<pad>', eos_token='<eos>')


def longest_match_ids(vocab: dict[str, int], text: str) -> list[int]:
    """Greedy longest-match tokenization (the synthetic vocabulary has no merges)."""
    longest = max(len(piece) for piece in vocab)
    ids, start = [], 0
    while start < len(text):
        end = next(end for end in range(min(len(text), start + longest), start, -1) if text[start:end] in vocab)
        ids.append(vocab[text[start:end]])
        start = end
    return ids


def median_seconds(action, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_schema(compiler: ConstraintCompiler, uncached: ConstraintCompiler, text: str, tokens: list[int],
                repeats: int) -> list[float]:
    """[cold ms, cached us, then us/token: fill, mask, verify, verify fill] for a valid output."""
    cold = median_seconds(lambda: uncached.compile(JSON_SCHEMA, text), repeats)
    compiler.compile(JSON_SCHEMA, text)
    cached = median_seconds(lambda: compiler.compile(JSON_SCHEMA, text), repeats * 100)
    constraint = compiler.constraint(json_schema=text)
    matcher = xgrammar.GrammarMatcher(compiler.compile(JSON_SCHEMA, text))
    bitmask = xgrammar.allocate_token_bitmask(1, compiler.vocab_size)

    def fill_only():  # xgrammar alone: fill the packed bitmask, accept
        for token in tokens:
            matcher.fill_next_token_bitmask(bitmask)
            matcher.accept_token(token)
        matcher.reset()

    def mask_each_token():  # plain decoding: a bool mask [1, vocab] per token, then accept
        for token in tokens:
            constraint.next_mask()
            constraint.accept([token])
        constraint.reset()

    def masks_along_drafts():  # speculative: masks for K drafts + 1 per round, accept the round
        for start in range(0, len(tokens), DRAFT_TOKENS + 1):
            round_tokens = tokens[start:start + DRAFT_TOKENS + 1]
            constraint.masks_along(round_tokens[:-1])
            constraint.accept(round_tokens)
        constraint.reset()

    def fill_along_drafts():  # the same with xgrammar alone (packed rows; a GPU would unpack them)
        rows = xgrammar.allocate_token_bitmask(DRAFT_TOKENS + 1, compiler.vocab_size)
        for start in range(0, len(tokens), DRAFT_TOKENS + 1):
            round_tokens = tokens[start:start + DRAFT_TOKENS + 1]
            matcher.fill_next_token_bitmask(rows, 0)
            for row, token in enumerate(round_tokens[:-1], start=1):
                matcher.accept_token(token)
                matcher.fill_next_token_bitmask(rows, row)
            matcher.rollback(len(round_tokens) - 1)
            for token in round_tokens:
                matcher.accept_token(token)
        matcher.reset()

    actions = (fill_only, mask_each_token, masks_along_drafts, fill_along_drafts)
    per_token = [1e6 * median_seconds(action, repeats) / len(tokens) for action in actions]
    return [1000 * cold, 1e6 * cached] + per_token


def time_vocabulary(label: str, tokenizer, vocab_size: int, encode, repeats: int) -> None:
    started = time.perf_counter()
    compiler = ConstraintCompiler(tokenizer, vocab_size, [tokenizer.eos_token_id])
    print('{}: vocab {:,}; tokenizer info {:.0f} ms (once per engine)'.format(
        label, vocab_size, 1000 * (time.perf_counter() - started)))
    uncached = ConstraintCompiler(tokenizer, vocab_size, [tokenizer.eos_token_id], cache_size=0)
    print('  {:<11} {:>7} {:>8} {:>9} {:>11} {:>11} {:>13} {:>13}'.format(
        'schema', 'tokens', 'cold ms', 'cached us', 'fill us/tok', 'mask us/tok', 'verify us/tok', 'v-fill us/tok'))
    for name, schema, instance in CASES:
        tokens = encode(json.dumps(instance))
        figures = time_schema(compiler, uncached, json.dumps(schema), tokens, repeats)
        print('  {:<11} {:>7} {:>8.1f} {:>9.1f} {:>11.1f} {:>11.1f} {:>13.1f} {:>13.1f}'.format(
            name, len(tokens), *figures))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog='python -m gemma_spec_ros bench grammar-timing', description=__doc__)
    parser.add_argument('--tokenizer', default='models/tokenizer', help='tokenizer directory (default: bundled)')
    parser.add_argument('--repeats', type=int, default=5, help='repeats per figure (median; default 5)')
    parser.add_argument('--skip-synthetic', action='store_true', help='time only the given tokenizer')
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(args.tokenizer))
    time_vocabulary(args.tokenizer, tokenizer, len(tokenizer), lambda text: tokenizer(
        text, add_special_tokens=False).input_ids, args.repeats)
    if not args.skip_synthetic:
        synthetic = synthetic_vocab_tokenizer(GEMMA_VOCAB)
        vocab = synthetic.get_vocab()
        time_vocabulary('synthetic', synthetic, len(vocab), lambda text: longest_match_ids(vocab, text),
                        args.repeats)
    print('columns: cold = compile without cache; fill = xgrammar bitmask + accept; mask = + unpack to bool '
          '[1, vocab] on the CPU; verify = masks_along K={} drafts + accept, per emitted token; v-fill = the '
          'same in xgrammar alone (a GPU engine unpacks on the device)'.format(DRAFT_TOKENS))
    return 0


if __name__ == '__main__':
    sys.exit(main())

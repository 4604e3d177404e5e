"""``python -m gemma_spec_ros train <tokenizer|target|draft|assistant|eval-drafter>``."""

import argparse
import random
import sys
import time
from pathlib import Path

from gemma_spec_ros.train import corpus


def add_corpus_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument('--input', nargs='+', metavar='PATH',
                        help='text files, directories or .jsonl ({"text": ...} per line); '
                             'default: Python stdlib sources + English docs on this machine')
    parser.add_argument('--seed', type=int, default=0, help='random seed')


def tokenizer_command(args: argparse.Namespace) -> int:
    from gemma_spec_ros.train.tokenizer import bytes_per_token, save_tokenizer, train_tokenizer

    random.seed(args.seed)
    start = time.time()
    train_docs = corpus.load_documents(args.input, 'train' if not args.input else 'all')
    print(f'training on {len(train_docs)} documents, {sum(len(d.text) for d in train_docs) / 1e6:.1f} M chars')
    tokenizer = train_tokenizer((d.text for d in train_docs), args.vocab_size)
    save_tokenizer(tokenizer, Path(args.out))
    if not args.input:
        for kind in ('code', 'prose'):
            held_out = [d.text for d in corpus.default_documents('heldout') if d.kind == kind]
            print(f'held-out {kind}: {bytes_per_token(tokenizer, held_out):.2f} bytes/token')
    print(f'saved {len(tokenizer)} tokens to {args.out} in {time.time() - start:.1f} s')
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog='python -m gemma_spec_ros train', description=__doc__)
    commands = parser.add_subparsers(dest='command', required=True)

    tok = commands.add_parser('tokenizer', help='train the byte-level BPE tokenizer')
    add_corpus_args(tok)
    tok.add_argument('--vocab-size', type=int, default=4096, help='vocabulary size incl. special tokens')
    tok.add_argument('--out', default='models/tokenizer', help='output directory')
    tok.set_defaults(run=tokenizer_command)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return args.run(args)
    except ValueError as error:
        print(f'error: {error}', file=sys.stderr)
        return 2

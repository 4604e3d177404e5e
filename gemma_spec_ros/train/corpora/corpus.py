"""
Text corpora for training: the default (Python stdlib + English docs on this machine) or user files.

A file is held out for evaluation when a hash of its path says so, so the split is stable across runs
and machines without a stored manifest.
"""

import hashlib
import json
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

HELD_OUT_PERCENT = 8           # share of files held out for evaluation
MAX_FILE_BYTES = 400_000       # skip huge generated files (tables, changelogs)
PROSE_SUFFIXES = ('.md', '.rst', '.txt')


@dataclass(frozen=True)
class Document:
    """One training or evaluation text with its origin."""

    source: str   # file path (and line for JSONL)
    kind: str     # 'code' or 'prose'
    text: str


def is_held_out(path: str) -> bool:
    """Say True for the stable ~HELD_OUT_PERCENT% of paths reserved for evaluation."""
    digest = hashlib.sha1(Path(path).as_posix().encode()).digest()
    return int.from_bytes(digest[:4], 'big') % 100 < HELD_OUT_PERCENT


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()['stdlib'])


def stdlib_files(root: Path) -> list[Path]:
    """Python sources of the standard library, without tests and third-party packages."""
    skip = {'site-packages', 'test', 'tests', 'idle_test', '__pycache__'}
    return sorted(p for p in root.rglob('*.py') if not skip.intersection(p.relative_to(root).parts))


def prose_files() -> list[Path]:
    """English documentation on this machine: /usr/share/doc and the docs shipped inside the venv."""
    files = []
    doc = Path('/usr/share/doc')
    if doc.is_dir():
        files += [p for p in doc.rglob('*') if p.is_file() and 'changelog' not in str(p).lower()
                  and (p.suffix in PROSE_SUFFIXES or p.name.startswith('README'))]
    site = Path(sysconfig.get_paths()['purelib'])
    if site.is_dir() and site.resolve() != stdlib_root().resolve():
        files += [p for p in site.rglob('*') if p.is_file() and (p.suffix in ('.md', '.rst') or p.name == 'METADATA')]
    return sorted(files)


def read_text(path: Path) -> str | None:
    """File contents as text, or None for binary, empty or oversized files."""
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            return None
        text = path.read_bytes().decode('utf-8')
    except (OSError, UnicodeDecodeError):
        return None
    return text if text.strip() and '\x00' not in text else None


def default_documents(split: str) -> Iterator[Document]:
    """Yield the default corpus: stdlib code and machine docs; split is 'train' or 'heldout'."""
    check_split(split)
    for kind, paths in (('code', stdlib_files(stdlib_root())), ('prose', prose_files())):
        for path in paths:
            if is_held_out(str(path)) == (split == 'heldout'):
                text = read_text(path)
                if text is not None:
                    yield Document(str(path), kind, text)


def file_documents(paths: list[str], split: str = 'all') -> Iterator[Document]:
    """
    Documents from user files or directories: .jsonl lines with a "text" field, anything else as plain text.

    With split 'train' or 'heldout' the same path-hash split as the default corpus applies to each file.
    """
    if split != 'all':
        check_split(split)
    for name in paths:
        root = Path(name)
        if not root.exists():
            raise ValueError(f'corpus path does not exist: {name}')
        files = sorted(p for p in root.rglob('*') if p.is_file()) if root.is_dir() else [root]
        for path in files:
            if split != 'all' and is_held_out(str(path)) != (split == 'heldout'):
                continue
            if path.suffix == '.jsonl':
                yield from jsonl_documents(path)
                continue
            text = read_text(path)
            if text is not None:
                yield Document(str(path), 'code' if path.suffix == '.py' else 'prose', text)


def jsonl_documents(path: Path) -> Iterator[Document]:
    with path.open(encoding='utf-8') as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f'{path}:{number}: not valid JSON ({error.msg})') from None
            if not isinstance(record, dict) or not isinstance(record.get('text'), str):
                raise ValueError(f'{path}:{number}: each JSONL line needs a string field "text"')
            yield Document(f'{path}:{number}', 'prose', record['text'])


def load_documents(inputs: list[str] | None, split: str) -> list[Document]:
    """User inputs when given (split by path hash unless split is 'all'), else the default corpus."""
    documents = list(file_documents(inputs, split) if inputs else default_documents(split))
    if not documents:
        raise ValueError(f'no readable text found for split {split!r} in {inputs or "the default corpus"}')
    return documents


def check_split(split: str) -> None:
    if split not in ('train', 'heldout'):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")


"""
Export the bundled models (target, draft, MTP assistant) to GGUF for llama.cpp / llama_ros.

Runs llama.cpp's own converter (convert_hf_to_gguf.py of the llama-cpp-python sdist that
scripts/setup_llamacpp.sh unpacks) with one change: the vocabulary. llama.cpp's Gemma 4 converter only reads
SentencePiece-style BPE tokenizers (byte_fallback, '▁' for spaces); ours is a byte-level BPE (GPT-2 style), so the
converter stops at "Cannot find Llama BPE tokenizer". Here the Gemma 4 vocabulary is written through the
converter's generic GPT-2 BPE path (tokenizer.ggml.model "gpt2", our merges), with the GPT-2 pre-tokenizer regex,
which is exactly ours (ByteLevel, use_regex). The models and tokenizer files are not changed; llama.cpp then
tokenizes and decodes like transformers (docs/llamacpp.md).

Run it with the llama.cpp venv's Python (it needs the converter's torch, gguf and transformers):

    .venv-llamacpp/bin/python scripts/export_gguf.py --out out/gguf
"""

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = {'target': 'models/gemma4-spec-target', 'draft': 'models/gemma4-spec-draft',
          'assistant': 'models/gemma4-spec-assistant'}
OUTTYPES = ('f32', 'f16', 'q8_0')


def default_converter_dir() -> Path | None:
    """Return the vendored llama.cpp of the sdist in .venv-llamacpp/src (the newest version), None without one."""
    found = sorted(ROOT.glob('.venv-llamacpp/src/llama_cpp_python-*/vendor/llama.cpp/convert_hf_to_gguf.py'))
    return found[-1].parent if found else None


def patch_converter(converter_dir: Path):
    """Import the converter with the byte-level vocabulary; return its module."""
    sys.path.insert(0, str(converter_dir))
    import convert_hf_to_gguf
    from conversion import gemma
    from conversion.base import TextModel

    def set_vocab_bytelevel(self) -> None:
        self._set_vocab_gpt2()  # tokenizer.ggml.model = gpt2: llama.cpp's byte-level BPE, merges from tokenizer.json
        self.gguf_writer.add_add_space_prefix(False)
        self.gguf_writer.add_add_bos_token(True)

    known_pre_tokenizer = TextModel.get_vocab_base_pre

    def vocab_base_pre(self, tokenizer) -> str:
        # The converter knows pre-tokenizers by a hash of sample tokenizations and ours is not listed; it is
        # ByteLevel(use_regex=True), i.e. GPT-2's regex.
        try:
            return known_pre_tokenizer(self, tokenizer)
        except NotImplementedError:
            return 'gpt-2'

    gemma.Gemma4Model.set_vocab = set_vocab_bytelevel
    TextModel.get_vocab_base_pre = vocab_base_pre
    return convert_hf_to_gguf


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--out', required=True, help='output folder (created)')
    parser.add_argument('--models', default=','.join(MODELS), help='comma-separated: target, draft, assistant')
    parser.add_argument('--outtypes', default=','.join(OUTTYPES), help='comma-separated: f32, f16, q8_0')
    parser.add_argument('--converter', help='llama.cpp source folder with convert_hf_to_gguf.py '
                                            '(default: the sdist unpacked by scripts/setup_llamacpp.sh)')
    args = parser.parse_args()
    models = [name.strip() for name in args.models.split(',') if name.strip()]
    outtypes = [name.strip() for name in args.outtypes.split(',') if name.strip()]
    unknown = [name for name in models if name not in MODELS] + [name for name in outtypes if name not in OUTTYPES]
    if unknown or not models or not outtypes:
        parser.error('choose models from {} and outtypes from {}, got {}'.format(
            ', '.join(MODELS), ', '.join(OUTTYPES), ', '.join(unknown) or 'none'))
    converter_dir = Path(args.converter) if args.converter else default_converter_dir()
    if converter_dir is None or not (converter_dir / 'convert_hf_to_gguf.py').exists():
        parser.error('no convert_hf_to_gguf.py in {} (run scripts/setup_llamacpp.sh or pass --converter)'.format(
            converter_dir or ROOT / '.venv-llamacpp/src'))
    os.environ.setdefault('HF_HUB_OFFLINE', '1')
    converter = patch_converter(converter_dir)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for model in models:
        for outtype in outtypes:
            path = out / 'gemma4-spec-{}-{}.gguf'.format(model, outtype)
            sys.argv = ['convert_hf_to_gguf.py', str(ROOT / MODELS[model]), '--outtype', outtype, '--outfile',
                        str(path)]
            converter.main()
            print('export_gguf: wrote {} ({:.1f} MB)'.format(path, path.stat().st_size / 1e6), flush=True)
    return 0


if __name__ == '__main__':
    sys.exit(main())

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

Any other Gemma 4 checkpoint folder with our tokenizer (the E2B-shape model of `bench quantization e2b-write`)
converts the same way; --quantize then makes llama.cpp's quantized types from the f16 file with llama.cpp's own
quantizer (llama_model_quantize), as llama-quantize does:

    .venv-llamacpp/bin/python scripts/export_gguf.py --out /work/e2b/gguf --source /work/e2b/hf/target \
        --name e2b --outtypes f16 --quantize q8_0,q4_0,q4_k_m
"""

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = {'target': 'models/gemma4-spec-target', 'draft': 'models/gemma4-spec-draft',
          'assistant': 'models/gemma4-spec-assistant'}
OUTTYPES = ('f32', 'f16', 'q8_0')
QUANTIZED = {'q8_0': 'LLAMA_FTYPE_MOSTLY_Q8_0', 'q4_0': 'LLAMA_FTYPE_MOSTLY_Q4_0',
             'q4_k_m': 'LLAMA_FTYPE_MOSTLY_Q4_K_M'}


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


def padded_copy(source: Path, scratch: Path) -> Path:
    """
    Return a copy of a checkpoint folder whose tokenizer has as many tokens as its embedding has rows.

    llama.cpp's Gemma converter cuts the token embedding to the tokenizer's size; a model whose vocab_size is larger
    (the E2B shape's 262,144 rows with our 4,096-token tokenizer) would lose rows and fail to load. Unused added tokens
    fill the gap; every other file is linked, not copied.
    """
    config = json.loads((source / 'config.json').read_text())
    rows = config.get('vocab_size') or config.get('text_config', {}).get('vocab_size')
    tokenizer = json.loads((source / 'tokenizer.json').read_text())
    taken = set(tokenizer['model']['vocab'].values()) | {token['id'] for token in tokenizer['added_tokens']}
    copy = scratch / source.name
    copy.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.name != 'tokenizer.json' and not (copy / path.name).exists():
            (copy / path.name).symlink_to(path.resolve())
    tokenizer['added_tokens'] += [
        {'id': index, 'content': '<unused{}>'.format(index), 'single_word': False, 'lstrip': False, 'rstrip': False,
         'normalized': False, 'special': True} for index in range(max(taken) + 1, rows or 0)]
    (copy / 'tokenizer.json').write_text(json.dumps(tokenizer))
    return copy


def quantize(source: Path, out: Path, kind: str, threads: int) -> None:
    """llama.cpp's quantizer (the code behind llama-quantize) from a float GGUF to one of QUANTIZED."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, QUANTIZED[kind])
    params.nthread = threads
    if llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), params) != 0:
        raise RuntimeError('llama_model_quantize failed for {} -> {}'.format(source, out))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--out', required=True, help='output folder (created)')
    parser.add_argument('--models', default=','.join(MODELS), help='comma-separated: target, draft, assistant')
    parser.add_argument('--outtypes', default=','.join(OUTTYPES), help='comma-separated: f32, f16, q8_0')
    parser.add_argument('--source', help='convert this checkpoint folder instead of the bundled models')
    parser.add_argument('--name', help='--source: the files\' name, <name>-<type>.gguf (default: the folder name)')
    parser.add_argument('--quantize', default='', help='comma-separated {}: made from the f16 file by llama.cpp\'s '
                                                       'quantizer'.format(', '.join(QUANTIZED)))
    parser.add_argument('--threads', type=int, default=2, help='--quantize')
    parser.add_argument('--converter', help='llama.cpp source folder with convert_hf_to_gguf.py '
                                            '(default: the sdist unpacked by scripts/setup_llamacpp.sh)')
    args = parser.parse_args()
    models = [name.strip() for name in args.models.split(',') if name.strip()]
    outtypes = [name.strip() for name in args.outtypes.split(',') if name.strip()]
    quantized = [name.strip() for name in args.quantize.split(',') if name.strip()]
    unknown = [name for name in models if name not in MODELS and not args.source] + \
        [name for name in outtypes if name not in OUTTYPES] + [name for name in quantized if name not in QUANTIZED]
    if unknown or not models or not outtypes:
        parser.error('choose models from {}, outtypes from {} and --quantize from {}; got {}'.format(
            ', '.join(MODELS), ', '.join(OUTTYPES), ', '.join(QUANTIZED), ', '.join(unknown) or 'none'))
    if quantized and 'f16' not in outtypes:
        parser.error('--quantize starts from the f16 file: add f16 to --outtypes')
    scratch = tempfile.TemporaryDirectory()
    sources = {args.name or Path(args.source).name: padded_copy(Path(args.source), Path(scratch.name))} \
        if args.source else \
        {'gemma4-spec-' + model: ROOT / MODELS[model] for model in models}
    converter_dir = Path(args.converter) if args.converter else default_converter_dir()
    if converter_dir is None or not (converter_dir / 'convert_hf_to_gguf.py').exists():
        parser.error('no convert_hf_to_gguf.py in {} (run scripts/setup_llamacpp.sh or pass --converter)'.format(
            converter_dir or ROOT / '.venv-llamacpp/src'))
    os.environ.setdefault('HF_HUB_OFFLINE', '1')
    converter = patch_converter(converter_dir)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for stem, source in sources.items():
        for outtype in outtypes:
            path = out / '{}-{}.gguf'.format(stem, outtype)
            sys.argv = ['convert_hf_to_gguf.py', str(source), '--outtype', outtype, '--outfile', str(path)]
            converter.main()
            print('export_gguf: wrote {} ({:.1f} MB)'.format(path, path.stat().st_size / 1e6), flush=True)
        for kind in quantized:
            path = out / '{}-{}.gguf'.format(stem, kind)
            quantize(out / '{}-f16.gguf'.format(stem), path, kind, args.threads)
            print('export_gguf: quantized {} ({:.1f} MB)'.format(path, path.stat().st_size / 1e6), flush=True)
    return 0


if __name__ == '__main__':
    sys.exit(main())

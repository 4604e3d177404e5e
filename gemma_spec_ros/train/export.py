"""Writing from_pretrained-loadable model directories with the tokenizer copied in."""

import copy
import json
import shutil
from pathlib import Path

import torch

TOKENIZER_FILES = ('tokenizer.json', 'tokenizer_config.json', 'chat_template.jinja', 'special_tokens_map.json')


def save_model(model: torch.nn.Module, out_dir: Path, tokenizer_dir: Path, storage_dtype: torch.dtype,
               report: dict) -> None:
    """save_pretrained in storage_dtype, but with config dtype float32 so a plain from_pretrained upcasts on load."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stored = copy.deepcopy(model).to(storage_dtype)
    stored.save_pretrained(out_dir)
    config_path = out_dir / 'config.json'
    config = json.loads(config_path.read_text())
    config['dtype'] = 'float32'
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + '\n')
    copy_tokenizer(tokenizer_dir, out_dir)
    (out_dir / 'training.json').write_text(json.dumps(report, indent=2) + '\n')


def copy_tokenizer(tokenizer_dir: Path, out_dir: Path) -> None:
    if Path(tokenizer_dir).resolve() == Path(out_dir).resolve():
        return
    found = [name for name in TOKENIZER_FILES if (Path(tokenizer_dir) / name).exists()]
    if 'tokenizer.json' not in found:
        raise ValueError(f'no tokenizer.json in {tokenizer_dir}')
    for name in found:
        shutil.copy(Path(tokenizer_dir) / name, out_dir / name)


def storage_dtype(name: str) -> torch.dtype:
    dtypes = {'float32': torch.float32, 'float16': torch.float16, 'bfloat16': torch.bfloat16}
    if name not in dtypes:
        raise ValueError(f'storage dtype must be one of {sorted(dtypes)}, got {name!r}')
    return dtypes[name]

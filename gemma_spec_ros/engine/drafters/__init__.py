"""
Drafters by name. Each lives in its own module behind the ``Drafter`` interface (drafters/base.py).

The registry is torch-free, so configs, parameters and tools can list drafters without loading models. Adding a
drafter means writing its module and adding one line here.
"""

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class DrafterSpec:
    """Where a drafter lives and which EngineConfig field names its model directory ('' = needs no model)."""

    module: str        # module under gemma_spec_ros.engine.drafters
    class_name: str
    path_field: str    # EngineConfig field with the model directory, '' when the drafter has no model
    role: str          # what the model is called in messages


REGISTRY = {
    'none': DrafterSpec('none', 'NoneDrafter', '', 'plain decoding'),
    'mtp': DrafterSpec('mtp', 'MtpDrafter', 'assistant_path', 'MTP assistant'),
    'draft': DrafterSpec('draft_model', 'DraftModelDrafter', 'draft_model_path', 'draft model'),
    'ngram': DrafterSpec('ngram', 'NgramDrafter', '', 'prompt lookup'),
}
DRAFTERS = tuple(REGISTRY)


def drafter_class(name: str):
    """Import and return the Drafter class registered as name."""
    spec = REGISTRY[name]
    return getattr(importlib.import_module('{}.{}'.format(__name__, spec.module)), spec.class_name)

"""
Drafters by name. Each lives in its own module behind the ``Drafter`` interface (drafters/base.py).

The table of names (types.REGISTRY: module, class, model path field) is torch-free and part of the engine's public
types, so configs, parameters and tools can list drafters without loading models. Adding a drafter means writing its
module and adding one line there. ``auto`` (types.AUTO) is no drafter of its own: decoding/auto.py picks one of
these every round.
"""

import importlib

from ..types import REGISTRY


def drafter_class(name: str):
    """Import and return the Drafter class registered as name."""
    spec = REGISTRY[name]
    return getattr(importlib.import_module('{}.{}'.format(__name__, spec.module)), spec.class_name)

"""
Benchmark of the engine against transformers generate and assisted generation.

Run with ``python -m gemma_spec_ros bench [--quick]``; docs/benchmark.md#outputs-in---out describes the outputs.
The measuring scripts beside it run with ``python -m gemma_spec_ros.benchmarks.<name>``; the prompt sets and the
results live in the repository's top-level bench/ folder.
"""

from gemma_spec_ros.benchmarks.cli import main

__all__ = ['main']

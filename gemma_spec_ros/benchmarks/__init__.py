"""
Benchmark of the engine against transformers generate and assisted generation.

Run with ``python -m gemma_spec_ros bench [--quick]``; docs/benchmark.md#outputs-in---out describes the outputs.
"""

from gemma_spec_ros.benchmarks.cli import main

__all__ = ['main']

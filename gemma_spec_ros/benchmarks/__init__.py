"""
The lab's measurements: development only, not installed on a robot (setup.py leaves benchmarks and train out).

``python -m gemma_spec_ros bench [--quick]`` runs the main benchmark against transformers' generate and assisted
generation (docs/benchmark.md#outputs-in---out); ``python -m gemma_spec_ros bench STUDY`` runs one of the studies
in decode/, output/, peers/ and faults/ (``bench --help`` lists them). The prompt sets and the results live in the
repository's top-level bench/ folder.
"""

from gemma_spec_ros.benchmarks.cli import main

__all__ = ['main']

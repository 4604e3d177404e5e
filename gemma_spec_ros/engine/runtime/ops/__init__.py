"""
The bottom room of the runtime: what reaches below PyTorch's public surface.

- cpu_ops.py (cpu_attention.cpp, int8_linear.cpp, lane_totals.h): the C++ CPU ops, attention and the int8 product,
  built on first use into the cache, behind a lock that a dead owner cannot hold forever.
- compile_cache.py: inductor's on-disk cache under ~/.cache/gemma_spec_ros, and releasing compile garbage.
- torch_internals.py: the one module that touches torch's private APIs (probed, with a public fallback).
"""

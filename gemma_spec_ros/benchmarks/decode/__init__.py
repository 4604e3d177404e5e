"""
Measurements of the decode path, each a study of ``python -m gemma_spec_ros bench STUDY``.

prefix, quantization, batching, drafters (the drafters and auto, per category), fast_measure (compiled passes,
warm-up, threads), bandwidth (the memory-bandwidth roofline), acceptance_map, adaptive_replay, gpu_check
(scripts/device_check.sh), and probe (the forward-cost probe the main run takes before and after).
"""

"""
Weight-only quantization (engine.quantization: int8, int4, float16).

- quantize.py: the quantized weight, its products, and which matrices are quantized.
- loading.py: loading a checkpoint straight into its quantized form, so that every float weight is never held at once.
"""

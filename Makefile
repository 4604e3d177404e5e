# The two commands: `make run` (ros2 launch of the node on the bundled models + the planner demo) and `make test`.
SHELL := /bin/bash
ENV := source scripts/env.sh
PARAMS ?= config/orin.yaml

.PHONY: setup run test lint bench clean

setup:
	@bash scripts/setup.sh

run: setup
	@bash scripts/run.sh $(PARAMS)

test: setup
	@$(ENV) && python -m pytest test -q -p no:cacheprovider $(PYTEST_ARGS)

lint: setup
	@$(ENV) && ruff check gemma_spec_ros test launch

bench: setup
	@$(ENV) && python -m gemma_spec_ros bench $(BENCH_ARGS)

clean:
	rm -rf build .venv

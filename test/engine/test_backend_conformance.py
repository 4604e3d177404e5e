"""The Backend conformance suite (backend_conformance.py) on the local engine: the tiny random Gemma 4 models."""

import pytest
from backend_conformance import BackendConformance

from gemma_spec_ros.engine.types import GenerationRequest


class TestLocalEngine(BackendConformance):
    @pytest.fixture
    def conforming(self, tiny_engine):
        return tiny_engine

    def prompt_ids(self, conforming, text):
        return conforming.validate(GenerationRequest(prompt=text)).prompt_ids

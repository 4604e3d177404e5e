"""The fence around torch's private APIs (runtime/ops/torch_internals.py): one missing, the public path serves."""

import warnings

import pytest
import torch

from gemma_spec_ros.engine.runtime.ops import torch_internals
from gemma_spec_ros.engine.runtime.steps.runner import FastCausalLM

CONTEXT = 64
MAX_QUERY = 2


def _tiny_model():
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    torch.manual_seed(7)
    config = Gemma4TextConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        layer_types=['sliding_attention', 'full_attention'], num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, global_head_dim=16, sliding_window=8, hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0, max_position_embeddings=256, initializer_range=0.2, pad_token_id=0,
        eos_token_id=1, bos_token_id=2)
    return Gemma4ForCausalLM(config).eval()


def _greedy(runner: FastCausalLM, prompt: list[int], count: int) -> list[int]:
    """Prefill prompt, then count one-token steps, each fed the argmax of the last."""
    runner.reset()
    token = runner.prefill(torch.tensor([prompt])).logits[0, -1].argmax()
    tokens = []
    for _ in range(count):
        tokens.append(int(token))
        token = runner.step(token.view(1, 1), 1).logits[0, -1].argmax()
    return tokens


@pytest.fixture
def api_missing(monkeypatch):
    """Make the probe find one private API missing (probed afresh; the real probe's result comes back after)."""
    missing_api = ('torch._inductor.compile_fx', 'compile_fx_that_is_gone')
    monkeypatch.setattr(torch_internals, 'PRIVATE_APIS', (*torch_internals.PRIVATE_APIS, missing_api))
    monkeypatch.setattr(torch_internals, '_probed', None)
    return '.'.join(missing_api)


def test_the_tested_torch_takes_the_private_path():
    assert torch_internals.missing() is None, torch_internals.missing()
    assert torch_internals.direct_graphs()


def test_a_torch_outside_the_tested_releases_takes_the_public_path(monkeypatch):
    monkeypatch.setattr(torch, '__version__', '2.99.0')
    monkeypatch.setattr(torch_internals, '_probed', None)
    with pytest.warns(torch_internals.TorchInternalsWarning, match='torch 2.99.0 is outside the releases'):
        assert not torch_internals.direct_graphs()
    assert torch_internals.compile_options({'cpp_wrapper': True}, {'freezing': True}) == {
        'cpp_wrapper': True, 'freezing': True}


def test_with_a_private_api_missing_compiled_steps_give_the_eager_tokens_and_one_warning(api_missing):
    torch.set_num_threads(1)
    model = _tiny_model()
    prompt = [5, 17, 33, 64, 9]
    expected = _greedy(FastCausalLM(model, CONTEXT, MAX_QUERY, 'eager'), prompt, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        compiled = FastCausalLM(model, CONTEXT, MAX_QUERY, 'inductor')
        assert _greedy(compiled, prompt, 8) == expected
        again = FastCausalLM(model, CONTEXT, MAX_QUERY, 'inductor')  # probed once: no second warning
        assert _greedy(again, prompt, 3) == expected[:3]
    fence_warnings = [warning for warning in caught if issubclass(warning.category,
                                                                  torch_internals.TorchInternalsWarning)]
    assert len(fence_warnings) == 1
    message = str(fence_warnings[0].message)
    assert api_missing in message and 'public torch.compile' in message
    assert compiled._steps.graph_calls >= 8 and compiled._steps.eager_calls == 0  # compiled, through dynamo
    assert compiled._steps.direct_count == 0  # no graph called without dynamo's entry

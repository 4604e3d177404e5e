"""
Weight-only quantization (engine.quantization).

The kernels, and speculative decoding lossless against the quantized target: greedy (every drafter) and sampled
(χ² against the quantized target's own distribution).
"""

import dataclasses
from collections import Counter

import pytest
import torch
from conftest import ON_TEST_DEVICE, chi_squared_p_value, sampling_distribution

from gemma_spec_ros.engine import Engine, GenerationRequest
from gemma_spec_ros.engine.runtime import FastCausalLM
from gemma_spec_ros.engine.runtime.model import checkpoints as model_loading
from gemma_spec_ros.engine.runtime.quant.quantize import (
    QuantizedWeight,
    Quantizer,
    int8_rows,
    quantized_linear,
    rounded_activations,
)

PROMPT = 'The robot picked up the red cube and'
SAMPLING_PROMPT = 'the the the cube the the'
SAMPLES = 1000
TOP_K = 3
OUTPUT_LENGTH = 3


def _dequantized_int8(weight: QuantizedWeight) -> torch.Tensor:
    return int8_rows(weight).float() * weight.scales.float()[:, None]


@pytest.mark.parametrize('mode, bound', [('int8', 0.02), ('int4', 0.15)])
def test_quantized_products_stay_close_to_float(mode, bound):
    torch.manual_seed(0)
    weight = torch.randn(256, 192) * 0.05
    quantizer = Quantizer(mode)
    quantized = quantizer.matrix(torch.nn.Parameter(weight.clone()))
    assert quantized.group_size == (32 if mode == 'int4' else 0)
    for rows in (1, 5, 40):
        x = torch.randn(rows, 192)
        exact = x @ weight.T
        out = quantized_linear(x, quantized)
        assert out.dtype == x.dtype and out.shape == exact.shape
        assert (out - exact).norm() / exact.norm() < bound
    report = quantizer.report
    assert report.matrices == 1 and report.bytes_before == weight.numel() * 4
    assert report.bytes_after < report.bytes_before / (6 if mode == 'int4' else 3)


def test_int8_product_is_the_dequantized_product():
    torch.manual_seed(1)
    quantized = Quantizer('int8').table(torch.nn.Parameter(torch.randn(64, 96)))
    x = torch.randn(3, 96)
    reference = rounded_activations(x) @ _dequantized_int8(quantized).T  # 16-bit levels per block of 32
    torch.testing.assert_close(quantized_linear(x, quantized), reference, rtol=1e-5, atol=1e-5)


def test_a_tied_parameter_is_quantized_once_and_its_float_data_released():
    quantizer = Quantizer('int4')
    parameter = torch.nn.Parameter(torch.randn(128, 64))
    first, again = quantizer.table(parameter), quantizer.matrix(parameter)
    assert first is again and first.group_size == 0  # a table is int8 whatever the mode
    assert parameter.numel() == 0 and quantizer.report.matrices == 1


def test_a_matrix_the_int4_kernel_does_not_take_stays_int8():
    quantizer = Quantizer('int4')
    assert quantizer.matrix(torch.nn.Parameter(torch.randn(64, 48))).group_size == 0  # 48 inputs: not groups of 32
    assert quantizer.matrix(torch.nn.Parameter(torch.randn(12, 64))).group_size == 0  # 12 outputs: not tiles of 8
    assert quantizer.report.int4_matrices == 0


def test_unknown_quantization_and_transformers_forward_are_refused(tiny_engine_config):
    with pytest.raises(ValueError, match='engine.quantization must be one of none|int8|int4'):
        Engine.from_config(dataclasses.replace(tiny_engine_config, quantization='int3'))
    with pytest.raises(ValueError, match='engine.quantization=int8 needs the lean forward'):
        Engine.from_config(dataclasses.replace(tiny_engine_config, quantization='int8', compile='transformers'))


@pytest.fixture(scope='module', params=['int8', 'int4', 'float16'])
def quantized_engine(request, tiny_engine_config):
    config = dataclasses.replace(tiny_engine_config, quantization=request.param)
    engine = Engine.from_config(config)
    yield engine
    engine.close()


def test_quantized_weights_are_smaller_and_reported(quantized_engine, tiny_engine):
    quantized, full = quantized_engine.status(), tiny_engine.status()
    runner = quantized_engine.target_lm
    assert isinstance(runner, FastCausalLM) and runner.quantization.mode == quantized_engine.config.quantization
    report = runner.quantization
    shrink = 2 if report.mode == 'float16' else 3  # float16 halves every matrix and table exactly
    assert report.bytes_after <= report.bytes_before / shrink
    # the target, the draft model and the MTP assistant shrink; the EAGLE-3 head stays in the engine's float dtype
    head = quantized_engine.drafter('eagle3').weights_bytes
    assert head == tiny_engine.drafter('eagle3').weights_bytes
    assert quantized.weights_bytes - head < (full.weights_bytes - head) / (shrink - 0.1)
    assert quantized_engine.drafter('mtp')._fast.quantization.matrices > 0


@pytest.mark.parametrize('drafter', ['none', 'ngram', 'draft', 'mtp', 'eagle3'])
@pytest.mark.parametrize('k', [0, 3])
def test_greedy_speculation_equals_plain_decoding_of_the_quantized_target(quantized_engine, drafter, k):
    prompt_ids = quantized_engine.tokenizer(PROMPT).input_ids
    plain = quantized_engine.generate(GenerationRequest(prompt_ids=prompt_ids, max_new_tokens=40, drafter='none'))
    result = quantized_engine.generate(GenerationRequest(prompt_ids=prompt_ids, max_new_tokens=40, drafter=drafter,
                                                         num_draft_tokens=k))
    assert result.token_ids == plain.token_ids and not result.warnings  # a failing drafter falls back to plain
    if drafter != 'none':
        assert result.stats.drafted_tokens > 0


def _quantized_next_logits(path: str, mode: str, prompt_ids: list[int]):
    """Return the quantized target's next-token logits after prompt_ids + prefix (a fresh runner's prefill)."""
    device = model_loading.resolve_device(ON_TEST_DEVICE['device'])
    quantizer = Quantizer(mode)
    runner = FastCausalLM(model_loading.load_causal_lm(path, 'target', device, torch.float32, quantizer), 64, 8,
                          'eager', quantizer)

    def next_logits(prefix: tuple[int, ...]) -> torch.Tensor:
        runner.reset()
        return runner.prefill(torch.tensor([prompt_ids + list(prefix)], device=device), logits_to_keep=1).logits[0, -1]
    return next_logits


@pytest.mark.parametrize('mode, drafter', [('int8', 'mtp'), ('int4', 'draft'), ('float16', 'mtp')])
def test_sampled_speculation_follows_the_quantized_target(tiny_models, tiny_engine_config, mode, drafter):
    engine = Engine.from_config(dataclasses.replace(tiny_engine_config, quantization=mode))
    prompt_ids = engine.tokenizer(SAMPLING_PROMPT).input_ids
    temperature = 2.0
    expected = sampling_distribution(_quantized_next_logits(tiny_models.target, mode, prompt_ids), temperature,
                                     TOP_K, OUTPUT_LENGTH)
    observed, drafted = Counter(), 0
    for seed in range(SAMPLES):
        result = engine.generate(GenerationRequest(prompt_ids=prompt_ids, max_new_tokens=OUTPUT_LENGTH,
                                                   temperature=temperature, top_k=TOP_K, seed=seed, drafter=drafter,
                                                   num_draft_tokens=2))
        observed[tuple(result.token_ids)] += 1
        drafted += result.stats.drafted_tokens
    engine.close()
    assert drafted > 0
    assert chi_squared_p_value(observed, expected) > 1e-3


def test_the_quantized_distribution_differs_from_float_where_the_test_has_power(tiny_models, tiny_engine):
    # the χ² reference above must be the quantized model's: against float int4 outputs must stand apart
    prompt_ids = tiny_engine.tokenizer(SAMPLING_PROMPT).input_ids
    quantized = _quantized_next_logits(tiny_models.target, 'int4', prompt_ids)(())
    full = tiny_engine.target_lm.model(torch.tensor([prompt_ids])).logits[0, -1]
    assert not torch.allclose(quantized, full, atol=1e-3)


@pytest.mark.parametrize('mode', ['int8', 'int4'])
def test_loading_into_quantized_weights_equals_quantizing_a_loaded_model(tiny_models, mode):
    # the engine's path (quantized_loading: row blocks read straight into integers) against quantizing a model that
    # from_pretrained loaded whole: the same weights, so the same logits
    device = model_loading.resolve_device(ON_TEST_DEVICE['device'])
    ids = torch.tensor([list(range(5, 40))], device=device)
    logits = []
    for streamed in (True, False):
        quantizer = Quantizer(mode)
        model = model_loading.load_causal_lm(tiny_models.target, 'target', device, torch.float32,
                                             quantizer if streamed else None)
        assert all(parameter.device.type != 'meta' for parameter in model.parameters())
        runner = FastCausalLM(model, 64, 8, 'eager', quantizer)
        assert runner.quantization.matrices == 4 * 7 + 1  # every layer matrix and the tied embedding
        logits.append(runner.prefill(ids, logits_to_keep=0).logits)
    assert torch.equal(logits[0], logits[1])


def test_an_eager_int8_verify_pass_gives_the_bits_of_one_token_steps(tiny_models):
    """Every CPU op of an int8 target's eager steps is exact per row: a pass of 5 tokens equals 5 steps of one."""
    device = model_loading.resolve_device(ON_TEST_DEVICE['device'])
    if device.type != 'cpu':
        pytest.skip('the row-exact ops are the CPU ones')
    quantizer = Quantizer('int8')
    runner = FastCausalLM(model_loading.load_causal_lm(tiny_models.target, 'target', device, torch.float32,
                                                       quantizer), 64, 8, 'eager', quantizer)
    prompt, drafts = torch.tensor([list(range(5, 30))]), list(range(40, 45))
    runner.prefill(prompt)
    together = runner.append(torch.tensor([drafts]), logits_to_keep=0).logits[0]
    runner.crop(-len(drafts))
    alone = torch.cat([runner.append(torch.tensor([[token]]), logits_to_keep=0).logits[0] for token in drafts])
    assert torch.equal(together, alone)


@pytest.mark.parametrize('mode', ['int8', 'int4', 'float16'])
def test_an_ordered_head_assistant_drafts_when_quantized(tiny_engine_config, tiny_models, mode):
    engine = Engine.from_config(dataclasses.replace(tiny_engine_config, quantization=mode,
                                                    assistant_path=tiny_models.assistant_ordered))
    prompt_ids = engine.tokenizer(PROMPT).input_ids
    plain = engine.generate(GenerationRequest(prompt_ids=prompt_ids, max_new_tokens=30, drafter='none'))
    result = engine.generate(GenerationRequest(prompt_ids=prompt_ids, max_new_tokens=30, drafter='mtp',
                                               num_draft_tokens=3))
    engine.close()
    assert result.token_ids == plain.token_ids and result.stats.drafted_tokens > 0 and not result.warnings


@pytest.mark.parametrize('role', ['target', 'draft', 'assistant', 'assistant_ordered'])
def test_a_quantized_load_has_the_buffers_from_pretrained_computes(tiny_models, role):
    path = getattr(tiny_models, role)
    load = model_loading.load_assistant if role.startswith('assistant') else (
        lambda path, device, dtype, quantizer=None: model_loading.load_causal_lm(path, role, device, dtype, quantizer))
    streamed = dict(load(path, torch.device('cpu'), torch.float32, Quantizer('int8')).named_buffers())
    loaded = dict(load(path, torch.device('cpu'), torch.float32).named_buffers())
    assert streamed.keys() == loaded.keys()
    for name, buffer in loaded.items():
        assert torch.equal(streamed[name], buffer), name


def test_e2b_bench_measures_our_engine_without_the_per_layer_table(tmp_path):
    """The E2B bench's row of ours on a tiny model with per-layer embeddings: a step reads all but that table."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    from gemma_spec_ros.benchmarks.decode.quantization import load_runner
    from gemma_spec_ros.benchmarks.peers import llamacpp_e2b
    from gemma_spec_ros.engine.runtime.steps.causal_lm import weights_bytes

    torch.manual_seed(0)
    config = Gemma4TextConfig(
        vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        layer_types=['sliding_attention', 'full_attention'], num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, global_head_dim=32, sliding_window=16, hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=4096, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    Gemma4ForCausalLM(config).eval().save_pretrained(tmp_path / 'target')
    row = llamacpp_e2b.measure_ours(tmp_path, 'int8', 1, 'eager', prompt_tokens=24, long_prompt=40, new_tokens=6,
                                    seed=0)
    assert len(row['token_ids']) == 6 and row['decode_tokens_per_s'] > 0
    assert set(row['prompt_tokens_per_s']) == {'24', '40'} and row['peak_rss_gib'] > 0
    runner, _ = load_runner(str(tmp_path / 'target'), 'int8', 'eager', 64)
    table = 4096 * 2 * 8  # int8 rows of the per-layer table, plus a scale per row
    assert weights_bytes(runner) - row['step_bytes'] >= table
    assert row['step_bytes'] < weights_bytes(runner) - table + 4096 * 4 + 1

"""The bundled models load offline, fit the size budget, and speculate losslessly through the engine."""

import json
import os
from pathlib import Path

import pytest
import torch

MODELS = Path(__file__).resolve().parents[2] / 'models'
TARGET, ASSISTANT, DRAFT, EAGLE3 = (MODELS / name for name in ('gemma4-spec-target', 'gemma4-spec-assistant',
                                                                'gemma4-spec-draft', 'gemma4-spec-eagle3'))
SIZE_BUDGET_BYTES = 40 * 1024 * 1024


@pytest.fixture(scope='module', autouse=True)
def offline():
    saved = {key: os.environ.get(key) for key in ('HF_HUB_OFFLINE', 'TRANSFORMERS_OFFLINE')}
    os.environ.update(HF_HUB_OFFLINE='1', TRANSFORMERS_OFFLINE='1')
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope='module')
def engine():
    from gemma_spec_ros.engine import Engine, EngineConfig

    return Engine.from_config(EngineConfig(target_path=str(TARGET), assistant_path=str(ASSISTANT),
                                           draft_model_path=str(DRAFT), device='cpu', dtype='float32',
                                           profit_gate=False, warmup='blocking'))


@pytest.fixture(scope='module')
def eagle3_engine():
    # eager steps: the head makes the target tap its states, so compiled steps would be graphs of their own
    from gemma_spec_ros.engine import Engine, EngineConfig

    return Engine.from_config(EngineConfig(target_path=str(TARGET), eagle3_path=str(EAGLE3), drafter='eagle3',
                                           device='cpu', dtype='float32', compile='eager', profit_gate=False))


def test_models_fit_the_size_budget():
    total = sum(f.stat().st_size for f in MODELS.rglob('*') if f.is_file())
    assert total <= SIZE_BUDGET_BYTES, f'models/ holds {total / 2**20:.1f} MiB'


@pytest.mark.parametrize('path', [TARGET, ASSISTANT, DRAFT, EAGLE3])
def test_model_dir_is_self_contained(path):
    from transformers import AutoTokenizer

    for name in ('eagle3.json' if path == EAGLE3 else 'config.json', 'model.safetensors', 'tokenizer.json',
                 'training.json'):
        assert (path / name).exists(), name
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id) == (0, 1, 2)
    assert tokenizer.chat_template


def test_models_load_in_float32_with_matching_shapes():
    from transformers import AutoModelForCausalLM, Gemma4AssistantForCausalLM

    target = AutoModelForCausalLM.from_pretrained(TARGET)
    draft = AutoModelForCausalLM.from_pretrained(DRAFT)
    assistant = Gemma4AssistantForCausalLM.from_pretrained(ASSISTANT)
    assert type(target).__name__ == 'Gemma4ForCausalLM' and target.dtype == torch.float32
    config = target.config
    assert config.hidden_size_per_layer_input == 0 and config.vocab_size_per_layer_input == 0
    assert set(config.layer_types) == {'sliding_attention', 'full_attention'}
    assert assistant.config.backbone_hidden_size == config.hidden_size
    assert draft.config.vocab_size == assistant.config.get_text_config().vocab_size == config.vocab_size
    assert json.loads((TARGET / 'training.json').read_text())['held_out_perplexity']


def _mapped_ranges(path: Path) -> list[tuple[int, int]]:
    """Address ranges where this process maps the file at path (/proc/self/maps)."""
    ranges = []
    with open('/proc/self/maps') as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].strip() == str(path):
                start, end = (int(address, 16) for address in fields[0].split('-'))
                ranges.append((start, end))
    return ranges


def test_a_loaded_model_keeps_no_view_of_its_checkpoint_file():
    # the assistant's int64 token ordering loads as stored: left a view, it kept the whole file mapped and resident
    from gemma_spec_ros.engine.runtime.model import checkpoints

    assistant = checkpoints.load_assistant(str(ASSISTANT), torch.device('cpu'), torch.float32)
    ranges = _mapped_ranges(ASSISTANT / 'model.safetensors')
    tensors = [*assistant.parameters(), *assistant.buffers()]
    assert assistant.masked_embedding.token_ordering.dtype == torch.int64
    assert not [tensor for tensor in tensors for start, end in ranges if start <= tensor.data_ptr() < end]


@pytest.mark.parametrize('drafter', ['mtp', 'draft', 'ngram'])
def test_speculation_matches_plain_greedy(engine, drafter):
    from gemma_spec_ros.engine import GenerationRequest

    prompt = 'def read_config(path):\n    """Read a JSON config file and return a dict."""\n'
    plain = engine.generate(GenerationRequest(prompt=prompt, max_new_tokens=24, drafter='none'))
    result = engine.generate(GenerationRequest(prompt=prompt, max_new_tokens=24, drafter=drafter,
                                               num_draft_tokens=4))
    assert result.stats.drafter == drafter and not result.warnings
    assert result.token_ids == plain.token_ids
    assert result.stats.tau >= 1.0


def test_chat_prompt_generates_text(engine):
    from gemma_spec_ros.engine import GenerationRequest

    messages = [{'role': 'user', 'content': 'List three rooms.'}]
    result = engine.generate(GenerationRequest(messages=messages, max_new_tokens=8, drafter='mtp'))
    # the messages reach the model as the chat template renders them, with the model's turn opened
    rendered = engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered.endswith('<|turn>model\n')
    templated = engine.tokenizer(rendered, add_special_tokens=False).input_ids
    assert engine.validate(GenerationRequest(messages=messages)).prompt_ids == templated
    plain = engine.generate(GenerationRequest(messages=messages, max_new_tokens=8, drafter='none'))
    assert result.stats.prompt_tokens == len(templated)
    assert (result.token_ids, result.text, result.finish_reason) == (plain.token_ids, plain.text, plain.finish_reason)
    # a chat turn without tools never calls one (the fine-tuned target would: it planned with tools)
    vocab = engine.tokenizer.get_vocab()
    assert vocab['<|tool_call>'] not in result.token_ids and vocab['<|channel>'] not in result.token_ids
    # the reply is text: the new tokens decoded, ended by the model's end of turn or by max_new_tokens
    assert result.text.strip() and result.stats.new_tokens == len(result.token_ids)
    assert result.text == engine.tokenizer.decode(result.token_ids, skip_special_tokens=True)
    ended_by_the_model = engine.tokenizer.convert_ids_to_tokens(result.token_ids[-1]) in (
        engine.tokenizer.eos_token, '<turn|>')
    assert result.finish_reason == ('stop' if ended_by_the_model else 'length')
    assert ended_by_the_model or len(result.token_ids) == 8


@pytest.mark.parametrize(('engine_fixture', 'drafter'), [('engine', 'lookahead'), ('eagle3_engine', 'eagle3')])
def test_sampled_drafts_follow_the_target_distribution(request, engine_fixture, drafter):
    # lookahead drafts only what its pool knows (the text, the target's predictions): on lines that repeat, the
    # trained target samples tokens its pool holds, so its drafts are taken and refused; so are the trained head's
    from collections import Counter

    from conftest import chi_squared_p_value, target_distribution

    from gemma_spec_ros.engine import GenerationRequest

    engine = request.getfixturevalue(engine_fixture)
    temperature, top_k, length, samples = 1.5, 3, 3, 300
    prompt_ids = engine.tokenizer('import os\nimport sys\nimport json\nimport os\nimport sys\nimport').input_ids
    expected = target_distribution(engine.target_lm.model, prompt_ids, temperature, top_k, length)
    assert sum(p * samples >= 5 for p in expected.values()) >= 8  # bins enough for power
    observed, drafted, accepted = Counter(), 0, 0
    for seed in range(samples):
        result = engine.generate(GenerationRequest(prompt_ids=prompt_ids, max_new_tokens=length,
                                                   temperature=temperature, top_k=top_k, seed=seed,
                                                   drafter=drafter, num_draft_tokens=2))
        observed[tuple(result.token_ids)] += 1
        drafted += result.stats.drafted_tokens
        accepted += result.stats.accepted_tokens
    assert 0 < accepted < drafted, (accepted, drafted)
    assert chi_squared_p_value(observed, expected) > 1e-3


def test_the_eagle3_head_drafts_what_plain_greedy_decoding_gives(eagle3_engine):
    from gemma_spec_ros.engine import GenerationRequest

    prompt = 'def read_config(path):\n    """Read a JSON config file and return a dict."""\n'
    plain = eagle3_engine.generate(GenerationRequest(prompt=prompt, max_new_tokens=32, drafter='none'))
    for k in (1, 4, 8):
        result = eagle3_engine.generate(GenerationRequest(prompt=prompt, max_new_tokens=32, num_draft_tokens=k))
        assert result.token_ids == plain.token_ids and result.stats.drafter == 'eagle3' and not result.warnings
        assert result.stats.tau > 1.2  # the trained head's drafts are taken

"""Bad requests, bad configs and mismatched models fail early with a message a planner developer understands."""

import json
import math
import re
import shutil

import pytest
import torch
from conftest import ON_TEST_DEVICE

from gemma_spec_ros.engine import Engine, EngineConfig, GenerationRequest, load_engine_config

BAD_REQUESTS = [
    (dict(), 'empty request'),
    (dict(prompt='hi', max_new_tokens=-1), 'max_new_tokens must be between 1 and'),
    (dict(prompt='hi', max_new_tokens=5000), 'max_new_tokens_limit'),
    (dict(prompt_ids=list(range(3, 1000)), max_new_tokens=100), 'exceeds the context limit of 1024'),
    (dict(prompt='hi', temperature=-0.1), 'temperature must be a finite number in [0, 2]'),
    (dict(prompt='hi', temperature=math.nan), 'temperature must be a finite number'),
    (dict(prompt='hi', temperature=math.inf), 'temperature must be a finite number'),
    (dict(prompt='hi', temperature=2.5), 'temperature must be a finite number'),
    (dict(prompt='hi', top_p=1.5), 'top_p must be in (0, 1]'),
    (dict(prompt='hi', top_p=-0.2), 'top_p must be in (0, 1]'),
    (dict(prompt='hi', top_k=-1), 'top_k must be >= 0'),
    (dict(prompt='hi', stop=['ok', '']), 'stop strings must not be empty'),
    (dict(prompt='hi', drafter='eagle'), "unknown drafter 'eagle'"),
    (dict(prompt='hi', num_draft_tokens=99), 'num_draft_tokens must be between 0'),
    (dict(prompt_ids=[1, 10**9]), 'prompt_ids must be token ids'),
    (dict(messages=[{'content': 'no role'}]), 'messages[0] needs string "role" and "content"'),
]


@pytest.mark.parametrize('fields, message', BAD_REQUESTS, ids=[m for _, m in BAD_REQUESTS])
def test_bad_request_rejected(tiny_engine, fields, message):
    for call in (tiny_engine.validate, tiny_engine.generate):
        with pytest.raises(ValueError) as error:
            call(GenerationRequest(**fields))
        assert message in str(error.value)


def test_drafter_not_loaded(tiny_models):
    engine = Engine.from_config(EngineConfig(target_path=tiny_models.target, drafter='none', **ON_TEST_DEVICE))
    with pytest.raises(ValueError, match='set engine.assistant_path'):
        engine.generate(GenerationRequest(prompt='hi', drafter='mtp'))
    with pytest.raises(ValueError, match='set engine.draft_model_path'):
        engine.set_default_drafter('draft')


@pytest.mark.parametrize('fields, message', [
    (dict(drafter='mtp', assistant_path=''), 'needs engine.assistant_path'),
    (dict(drafter='draft', draft_model_path=''), 'needs engine.draft_model_path'),
    (dict(drafter='beam'), "unknown drafter 'beam'"),
    (dict(drafter='ngram', assistant_path='/nonexistent/assistant'), 'does not exist'),
    (dict(drafter='none', device='tpu'), 'engine.device must be auto, cpu or cuda'),
    (dict(drafter='none', dtype='int8'), 'engine.dtype must be'),
    (dict(drafter='none', num_draft_tokens=9, max_draft_tokens=8), 'num_draft_tokens must be between'),
])
def test_bad_config_rejected(tiny_models, fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Engine.from_config(EngineConfig(target_path=tiny_models.target, **fields))


def test_pickle_bin_weights_refused(tiny_models, tmp_path):
    legacy = tmp_path / 'legacy'
    legacy.mkdir()
    shutil.copy(f'{tiny_models.target}/config.json', legacy / 'config.json')
    torch.save({'weight': torch.zeros(1)}, legacy / 'pytorch_model.bin')
    with pytest.raises(ValueError, match='pickle weights'):
        Engine.from_config(EngineConfig(target_path=str(legacy), drafter='none'))


def test_assistant_for_another_target_refused(tiny_models, tmp_path):
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM

    config = Gemma4AssistantConfig.from_pretrained(tiny_models.assistant)
    config.backbone_hidden_size = 48
    Gemma4AssistantForCausalLM(config).save_pretrained(tmp_path / 'wide')
    with pytest.raises(ValueError, match='backbone_hidden_size 48 but the target hidden_size is 64'):
        Engine.from_config(EngineConfig(target_path=tiny_models.target, drafter='mtp',
                                        assistant_path=str(tmp_path / 'wide')))


def test_assistant_head_shape_mismatch_refused(tiny_models, tmp_path):
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM

    config = Gemma4AssistantConfig.from_pretrained(tiny_models.assistant)
    text = config.text_config.to_dict()
    text.update(head_dim=8, per_layer_config=None)
    text.pop('per_layer_config')
    config = Gemma4AssistantConfig(text_config=text, backbone_hidden_size=64)
    Gemma4AssistantForCausalLM(config).save_pretrained(tmp_path / 'heads')
    with pytest.raises(ValueError, match='expects head_dim 8'):
        Engine.from_config(EngineConfig(target_path=tiny_models.target, drafter='mtp',
                                        assistant_path=str(tmp_path / 'heads')))


def test_draft_vocab_mismatch_refused(tiny_models, tmp_path):
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    config = Gemma4TextConfig.from_pretrained(tiny_models.draft)
    config.vocab_size = 512
    Gemma4ForCausalLM(config).save_pretrained(tmp_path / 'small_vocab')
    with pytest.raises(ValueError, match='vocab_size 512 but the target has'):
        Engine.from_config(EngineConfig(target_path=tiny_models.target, drafter='draft',
                                        draft_model_path=str(tmp_path / 'small_vocab')))


def test_draft_tokenizer_mismatch_refused(tiny_models, tmp_path):
    other = tmp_path / 'other_tokenizer'
    shutil.copytree(tiny_models.draft, other)
    tokenizer_json = json.loads((other / 'tokenizer.json').read_text())
    vocab = tokenizer_json['model']['vocab']
    first, second = list(vocab)[100:102]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (other / 'tokenizer.json').write_text(json.dumps(tokenizer_json))
    with pytest.raises(ValueError, match='differs from the target tokenizer'):
        Engine.from_config(EngineConfig(target_path=tiny_models.target, drafter='draft', draft_model_path=str(other)))


def test_unset_token_ordering_refused(tiny_models, tmp_path):
    from transformers import Gemma4AssistantForCausalLM

    assistant = Gemma4AssistantForCausalLM.from_pretrained(tiny_models.assistant_ordered)
    assistant.masked_embedding.token_ordering.zero_()
    assistant.save_pretrained(tmp_path / 'unordered')
    with pytest.raises(ValueError, match='token_ordering buffer is not a permutation'):
        Engine.from_config(EngineConfig(target_path=tiny_models.target, drafter='mtp',
                                        assistant_path=str(tmp_path / 'unordered')))


def test_failing_drafter_falls_back_to_plain_decoding(tiny_models, tiny_engine):
    drafter = tiny_engine.drafter('draft')
    original = drafter.propose

    def broken(context, k):
        raise RuntimeError('draft model exploded')

    drafter.propose = broken
    try:
        result = tiny_engine.generate(GenerationRequest(prompt='hello robot', max_new_tokens=12, drafter='draft',
                                                        num_draft_tokens=2))
    finally:
        drafter.propose = original
    plain = tiny_engine.generate(GenerationRequest(prompt='hello robot', max_new_tokens=12, drafter='none'))
    assert result.token_ids == plain.token_ids and result.stats.drafter == 'none'
    assert 'draft model exploded' in result.warnings[0] and 'fell back to plain decoding' in result.warnings[0]


def test_load_engine_config_from_params_file(tiny_models, tmp_path):
    params = tmp_path / 'params.yaml'
    params.write_text(
        '/**:\n  ros__parameters:\n    engine:\n      target_path: {}\n      drafter: ngram\n'
        '      max_draft_tokens: 6\n      profit_gate: false\n    generation:\n      temperature: 0.0\n'.format(
            tiny_models.target))
    config = load_engine_config(str(params), {'num_draft_tokens': 3, 'device': None})
    assert config.target_path == tiny_models.target and config.drafter == 'ngram'
    assert config.max_draft_tokens == 6 and config.num_draft_tokens == 3 and config.profit_gate is False
    params.write_text('/**:\n  ros__parameters:\n    engine:\n      target_path: x\n      speed: 11\n')
    with pytest.raises(ValueError, match='unknown engine parameter'):
        load_engine_config(str(params))
    params.write_text('/**:\n  ros__parameters:\n    engine:\n      target_path: x\n      max_draft_tokens: many\n')
    with pytest.raises(ValueError, match='engine.max_draft_tokens must be a int'):
        load_engine_config(str(params))


def test_resolve_model_path_search_order(tmp_path, monkeypatch):
    from gemma_spec_ros.engine.config_file import REPO_ROOT, resolve_model_path

    monkeypatch.chdir(tmp_path)
    assert resolve_model_path('/abs/model') == '/abs/model'
    assert resolve_model_path('models/tokenizer') == str(REPO_ROOT / 'models' / 'tokenizer')  # dev checkout
    (tmp_path / 'models' / 'tokenizer').mkdir(parents=True)
    assert resolve_model_path('models/tokenizer') == str(tmp_path / 'models' / 'tokenizer')  # cwd first
    prefix = tmp_path / 'install'
    (prefix / 'share' / 'gemma_spec_ros' / 'models' / 'only-installed').mkdir(parents=True)
    monkeypatch.setenv('AMENT_PREFIX_PATH', '/nonexistent:' + str(prefix))
    assert resolve_model_path('models/only-installed') == str(prefix / 'share/gemma_spec_ros/models/only-installed')


F32_MAX, F32_TINY = 3.4028234663852886e38, 1.401298464324817e-45   # float32 extremes a goal can carry
INT64_MIN, INT64_MAX, UINT32_MAX = -2 ** 63, 2 ** 63 - 1, 2 ** 32 - 1
EXTREMES = {
    'max_new_tokens': [0, 1, 2048, 2049, 2 ** 31 - 1, UINT32_MAX, -1, INT64_MIN],
    'temperature': [0.0, -0.0, 5e-324, F32_TINY, 1.1754943508222875e-38, 1e-30, 2.0, 2.0000002384185791, F32_MAX,
                    -F32_TINY, -F32_MAX, 1.7976931348623157e308],
    'top_p': [0.0, 5e-324, F32_TINY, 1e-30, 0.999999940395, 1.0, 1.0000001192092896, F32_MAX, -F32_TINY, -F32_MAX],
    'top_k': [0, 1, 1023, 1024, 1025, UINT32_MAX, INT64_MAX, -1, INT64_MIN],
    'seed': [-1, 0, 1, INT64_MAX, 2 ** 64 - 1, 2 ** 64, -2, INT64_MIN],
    'num_draft_tokens': [0, 1, 8, 9, 64, UINT32_MAX, -1, INT64_MIN],
}


@pytest.mark.parametrize('name', list(EXTREMES))
def test_extreme_numeric_values_never_reach_an_internal_error(tiny_engine, name):
    """Every extreme finite value of every numeric field either generates or is refused naming the field."""
    for value in EXTREMES[name]:
        fields = dict(prompt='robot, move', max_new_tokens=3, temperature=0.7, seed=5, drafter='draft')
        fields[name] = value
        request = GenerationRequest(**fields)
        try:
            plan = tiny_engine.validate(request)
        except ValueError as error:
            assert name in str(error), (value, str(error))
            continue
        result = tiny_engine.generate(plan)
        assert result.finish_reason in ('stop', 'length') and 1 <= len(result.token_ids) <= plan.max_new_tokens, value


def test_fatal_errors_are_told_by_type():
    from gemma_spec_ros.engine.backend import is_fatal_error

    assert is_fatal_error(MemoryError())
    assert is_fatal_error(torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB'))
    assert is_fatal_error(torch.AcceleratorError('CUDA error: an illegal memory access was encountered'))
    # a goal's own failure names a CUDA error in its text, but is no device fault: the node keeps serving
    assert not is_fatal_error(ValueError('CUDA error: in the prompt text'))
    assert not is_fatal_error(RuntimeError('CUDA error: a message, not the device'))
    assert not is_fatal_error(RuntimeError('shape mismatch'))

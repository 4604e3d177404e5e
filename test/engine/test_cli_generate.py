"""``python -m gemma_spec_ros generate`` on the tiny models (in-process main(argv), plus one real --help run)."""

import json
import re
import subprocess
import sys

import jsonschema
import pytest
from conftest import TEST_COMPILE

from gemma_spec_ros.engine.cli import main


def generate(argv: list[str]) -> int:
    """Run the command in-process on the tests' decode steps (engine.compile)."""
    return main(argv + ['--compile', TEST_COMPILE])


def test_help_runs():
    out = subprocess.run([sys.executable, '-m', 'gemma_spec_ros', 'generate', '--help'], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0
    for flag in ('--config', '--target', '--drafter', '--drafter-path', '--prompt-ids', '--messages-json',
                 '--num-draft-tokens', '--samples', '--json', '--json-schema', '--grammar', '--compile'):
        assert flag in out.stdout


def test_json_samples_with_consecutive_seeds(tiny_models, capsys):
    argv = ['--target', tiny_models.target, '--drafter', 'draft', '--drafter-path', tiny_models.draft,
            '--prompt', 'The robot', '--max-new-tokens', '8', '--temperature', '0.8', '--seed', '5',
            '--samples', '2', '--json', '--device', 'cpu']
    assert generate(argv) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(lines) == 2
    for line in lines:
        assert set(line) >= {'text', 'token_ids', 'finish_reason', 'stats'}
        assert len(line['token_ids']) == 8 and line['stats']['new_tokens'] == 8
    assert generate(argv[:-5] + ['--seed', '6', '--samples', '1', '--json']) == 0  # sample 2 used seed 6
    again = json.loads(capsys.readouterr().out.splitlines()[0])
    assert again['token_ids'] == lines[1]['token_ids']


def test_streams_text_then_stats(tiny_models, capsys):
    assert generate(['--target', tiny_models.target, '--drafter', 'ngram', '--prompt-ids', '2,651,300,651,300',
                 '--max-new-tokens', '6', '--num-draft-tokens', '2']) == 0
    out = capsys.readouterr().out
    assert '--- finish=length' in out and 'tokens 6 (prompt' in out and 'drafter ngram' in out and 'tok/s' in out


def test_messages_json_and_config_file(tiny_models, tmp_path, capsys):
    params = tmp_path / 'params.yaml'
    params.write_text('/**:\n  ros__parameters:\n    engine:\n      target_path: {}\n      drafter: mtp\n'
                      '      assistant_path: {}\n'.format(tiny_models.target, tiny_models.assistant))
    messages = tmp_path / 'messages.json'
    messages.write_text(json.dumps([{'role': 'user', 'content': 'go to the door'}]))
    assert generate(['--config', str(params), '--messages-json', str(messages), '--max-new-tokens', '4', '--json']) == 0
    line = json.loads(capsys.readouterr().out)
    assert line['stats']['drafter'] == 'mtp' or line['stats']['drafter'] == 'none'


def test_json_schema_and_grammar_files(tiny_models, tmp_path, capsys):
    # bounded: compact JSON gives random weights no whitespace to end an unbounded integer with
    schema = {'type': 'object', 'properties': {'mode': {'enum': ['idle', 'dock']},
                                               'speed': {'type': 'integer', 'minimum': 0, 'maximum': 99}},
              'required': ['mode', 'speed']}
    (tmp_path / 'schema.json').write_text(json.dumps(schema))
    (tmp_path / 'skills.gbnf').write_text('root ::= "pick(" [a-z]{1,8} ")"')
    argv = ['--target', tiny_models.target, '--drafter', 'ngram', '--prompt', 'Mode: ', '--max-new-tokens', '300']
    assert generate(argv + ['--json-schema', str(tmp_path / 'schema.json'), '--json']) == 0
    line = json.loads(capsys.readouterr().out)
    assert line['structure_complete'] and line['finish_reason'] == 'stop'
    jsonschema.validate(json.loads(line['text']), schema)
    assert not re.search(r'\s', line['text'])  # compact by default
    assert generate(argv + ['--json-schema', str(tmp_path / 'schema.json'), '--json-free-whitespace', '--json']) == 0
    line = json.loads(capsys.readouterr().out)
    assert line['structure_complete'] and re.search(r'\s', line['text'])  # random weights take whitespace offered
    jsonschema.validate(json.loads(line['text']), schema)
    assert generate(argv + ['--grammar', str(tmp_path / 'skills.gbnf')]) == 0
    out = capsys.readouterr().out
    assert re.match(r'pick\([a-z]{1,8}\)\n--- finish=stop\n', out) and '--- structure complete' in out


@pytest.mark.parametrize('extra, message', [
    (['--temperature', '3'], 'temperature must be'),
    (['--prompt-ids', '1,x'], '--prompt-ids must be comma-separated integers'),
    (['--samples', '0'], '--samples must be >= 1'),
    (['--json-schema', '/no/such/schema.json'], '--json-schema: cannot read /no/such/schema.json'),
    (['--grammar', 'test/data'], '--grammar: cannot read test/data'),
    (['--json-schema', 'test/data/../../package.xml'], 'json_schema: not valid JSON'),
    (['--json-free-whitespace'], 'json_free_whitespace applies to json_schema only'),
    (['--json-schema-unenforced', 'check'], 'json_schema_unenforced applies to json_schema only'),
])
def test_bad_input_exits_2_with_message(tiny_models, capsys, extra, message):
    argv = ['--target', tiny_models.target, '--drafter', 'none', '--max-new-tokens', '2']
    argv += extra if '--prompt-ids' in extra else ['--prompt', 'hi'] + extra
    assert generate(argv) == 2
    assert message in capsys.readouterr().err

"""
The managed node under launch_pytest, driven with the `ros2 lifecycle` CLI as an operator drives it.

orin.launch.py with autostart:=false starts the node unconfigured on the tiny random models; every transition is
then set with `ros2 lifecycle set` and read back with `ros2 lifecycle get`: a failed configure (bad model path)
and its retry once the parameter is fixed, activate, deactivate, cleanup (its memory report), configure again,
and shutdown. Goals are refused while the node is not active and served while it is.
"""

import os
from pathlib import Path

import pytest
import yaml
from conftest import TEST_COMPILE, LaunchOutput, missing_ros2_tools, orin_launch_description, run_ros2

if missing_ros2_tools():
    pytest.skip(missing_ros2_tools(), allow_module_level=True)

import launch_pytest
from ament_index_python.packages import get_package_share_directory

from gemma_spec_ros.tools.client import GenerateClient, make_goal

DOMAIN_ID = 11 + (os.getpid() + 47) % 80
ENV = dict(os.environ, ROS_DOMAIN_ID=str(DOMAIN_ID), ROS_AUTOMATIC_DISCOVERY_RANGE='LOCALHOST')
NODE = '/gemma_spec'
DISCOVERY_ATTEMPTS = 6  # a CLI call that has not discovered the node yet says 'Node not found'
DISCOVERY_SECONDS = '4'  # how long each CLI call waits to discover nodes; a loaded 2-core machine needs more than 2
PROMPT = 'The robot picked up the red cube and'
OUTPUT = LaunchOutput()


def ros2(command: str, verb: str, *args) -> tuple[int, str]:
    """
    Run `ros2 COMMAND VERB ...` without the ros2 daemon (the CLI discovers the node itself); exit code and output.

    A call that has not discovered the node yet says 'Node not found': it is tried again.
    """
    for _ in range(DISCOVERY_ATTEMPTS):
        code, output = run_ros2(ENV, command, verb, '--no-daemon', '--spin-time', DISCOVERY_SECONDS, *args,
                                timeout=180)
        if 'Node not found' not in output and (verb != 'nodes' or NODE in output):
            break
    return code, output


def lifecycle(verb, *args) -> str:
    """Run `ros2 lifecycle VERB ...` (see ros2); its output."""
    code, output = ros2('lifecycle', verb, *args)
    assert code == 0, output
    return output


@pytest.fixture(scope='module')
def params_file(tmp_path_factory, tiny_models):
    config = yaml.safe_load(Path(get_package_share_directory('gemma_spec_ros'), 'config', 'orin.yaml').read_text())
    params = config['/**']['ros__parameters']
    params['engine'].update(target_path=str(Path(tiny_models.target).parent / 'no_such_model'),
                            draft_model_path=tiny_models.draft, assistant_path=tiny_models.assistant,
                            drafter='ngram', num_threads=1, compile=TEST_COMPILE, dtype='float32')
    params['diagnostic_updater']['period'] = 0.2
    path = tmp_path_factory.mktemp('lifecycle') / 'params.yaml'
    path.write_text(yaml.safe_dump(config))
    return path


@launch_pytest.fixture(scope='module')
def manual_launch(params_file):
    return orin_launch_description(DOMAIN_ID, OUTPUT,
                                   {'params_file': str(params_file), 'device': 'cpu', 'autostart': 'false'})


@pytest.mark.launch(fixture=manual_launch)
def test_every_transition_with_the_ros2_lifecycle_cli(context, tiny_models):
    client = GenerateClient(NODE + '/generate', 'lifecycle_cli_client', context=context)
    try:
        assert client.wait_for_server(60)
        assert NODE in lifecycle('nodes')
        assert 'unconfigured' in lifecycle('get', NODE)
        refused = client.send(make_goal(PROMPT, max_new_tokens=4))
        assert refused.status == 'aborted' and 'unconfigured' in refused.result.error

        # a bad model path fails configure with the reason; fixing the parameter lets it configure
        assert 'Transitioning failed' in lifecycle('set', NODE, 'configure')
        assert 'unconfigured' in lifecycle('get', NODE)
        assert OUTPUT.wait_for('no_such_model does not exist', 10), OUTPUT.text[-2000:]
        code, output = ros2('param', 'set', NODE, 'engine.target_path', tiny_models.target)
        assert code == 0 and 'successful' in output, output
        assert 'Transitioning successful' in lifecycle('set', NODE, 'configure')
        assert 'inactive' in lifecycle('get', NODE)
        inactive = client.send(make_goal(PROMPT, max_new_tokens=4))
        assert inactive.status == 'aborted' and 'inactive' in inactive.result.error

        assert 'Transitioning successful' in lifecycle('set', NODE, 'activate')
        assert 'active' in lifecycle('get', NODE)
        served = client.send(make_goal(PROMPT, max_new_tokens=12, drafter='none'))
        assert served.status == 'succeeded', served.result.error

        for transition, state in (('deactivate', 'inactive'), ('cleanup', 'unconfigured'),
                                  ('configure', 'inactive'), ('activate', 'active')):
            assert 'Transitioning successful' in lifecycle('set', NODE, transition)
            assert state in lifecycle('get', NODE)
        assert 'backend released: process RSS' in OUTPUT.text
        again = client.send(make_goal(PROMPT, max_new_tokens=12, num_draft_tokens=2))
        assert again.status == 'succeeded'
        assert list(again.result.token_ids) == list(served.result.token_ids)  # speculative equals plain decoding

        assert 'Transitioning successful' in lifecycle('set', NODE, 'shutdown')
        assert 'finalized' in lifecycle('get', NODE)
    finally:
        client.close()


@pytest.mark.launch(fixture=manual_launch, shutdown=True)
def test_the_launch_ends_cleanly_after_shutdown():
    assert OUTPUT.exit_codes and set(OUTPUT.exit_codes.values()) == {0}, (OUTPUT.exit_codes, OUTPUT.text[-2000:])

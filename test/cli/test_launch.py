"""
orin.launch.py under launch_pytest, as ROS packages test their launch files: one launched node for the module.

Every launch argument is set away from its default (namespace, params_file, drafter, device, compile, log_level)
and each is checked where it shows in the running node; test_ros2_cli.py launches the defaults. The launched node
runs the bundled models on this module's own ROS domain, on localhost, with one torch thread.
"""

import os
import time
from pathlib import Path

import pytest
import yaml
from conftest import LaunchOutput, missing_ros2_tools, orin_launch_description, ready_client

if missing_ros2_tools():
    pytest.skip(missing_ros2_tools(), allow_module_level=True)

import launch_pytest
from ament_index_python.packages import get_package_share_directory
from diagnostic_msgs.msg import DiagnosticArray
from rcl_interfaces.srv import GetParameters
from rclpy.action import get_action_names_and_types
from rclpy.parameter import parameter_value_to_python

from gemma_spec_ros.tools.client import make_goal

DOMAIN_ID = 11 + (os.getpid() + 73) % 80
NAMESPACE = 'robot1'
ACTION = '/robot1/gemma_spec/generate'
HARDWARE_ID = 'launch-test-hw'
PERIOD = 0.5  # diagnostic_updater.period in the params file (orin.yaml has 1.0)
READY_TIMEOUT = 300.0


OUTPUT = LaunchOutput()


@pytest.fixture(scope='module')
def params_file(tmp_path_factory):
    """orin.yaml as installed, with the values this module checks changed."""
    config = yaml.safe_load(Path(get_package_share_directory('gemma_spec_ros'), 'config', 'orin.yaml').read_text())
    params = config['/**']['ros__parameters']
    params['engine']['num_threads'] = 1
    params['engine']['drafter'] = 'mtp'       # the drafter:=ngram argument must win over the file
    params['engine']['device'] = 'auto'       # and device:=cpu
    params['diagnostic_updater']['period'] = PERIOD
    params['diagnostics']['hardware_id'] = HARDWARE_ID
    params['queue']['max_length'] = 2
    path = tmp_path_factory.mktemp('launch') / 'params.yaml'
    path.write_text(yaml.safe_dump(config))
    return path


@launch_pytest.fixture(scope='module')
def orin_launch(params_file):
    return orin_launch_description(DOMAIN_ID, OUTPUT, {
        'namespace': NAMESPACE, 'params_file': str(params_file), 'drafter': 'ngram', 'device': 'cpu',
        'compile': 'eager', 'log_level': 'warn'})


@pytest.fixture(scope='module')
def ready(context):
    """Wait until /diagnostics say the launched node has loaded its models; yield a client on the module's domain."""
    with ready_client(context, ACTION, 'launch_test_client', READY_TIMEOUT) as client:
        yield client


@pytest.mark.launch(fixture=orin_launch)
def test_node_comes_up_with_its_action_under_the_namespace(ready):
    node = ready.node
    deadline = time.monotonic() + 30
    actions = topics = {}
    while time.monotonic() < deadline and not (ACTION in actions and '/diagnostics' in topics):
        time.sleep(0.2)
        actions = dict(get_action_names_and_types(node))
        topics = dict(node.get_topic_names_and_types())
    assert actions.get(ACTION) == ['gemma_spec_msgs/action/Generate'], actions
    assert '/gemma_spec/generate' not in actions
    assert topics.get('/diagnostics') == ['diagnostic_msgs/msg/DiagnosticArray']
    assert ready.wait_for_server(30)
    outcome = ready.send(make_goal('def add(a, b):', max_new_tokens=8))
    assert outcome.status == 'succeeded', outcome.result.error if outcome.result else outcome.status
    assert outcome.result.stats.drafter == 'ngram' and len(outcome.feedback) >= 1


@pytest.mark.launch(fixture=orin_launch)
def test_params_file_drafter_and_device_reach_the_node(ready):
    node = ready.node
    service = node.create_client(GetParameters, '/{}/gemma_spec/get_parameters'.format(NAMESPACE))
    assert service.wait_for_service(timeout_sec=30)
    names = ['engine.drafter', 'engine.device', 'engine.compile', 'engine.num_threads', 'queue.max_length',
             'diagnostics.hardware_id', 'diagnostic_updater.period']
    future = service.call_async(GetParameters.Request(names=names))
    deadline = time.monotonic() + 30
    while not future.done() and time.monotonic() < deadline:
        time.sleep(0.05)
    values = [parameter_value_to_python(v) for v in future.result().values]
    assert dict(zip(names, values, strict=True)) == {
        'engine.drafter': 'ngram', 'engine.device': 'cpu', 'engine.compile': 'eager', 'engine.num_threads': 1,
        'queue.max_length': 2,
        'diagnostics.hardware_id': HARDWARE_ID, 'diagnostic_updater.period': PERIOD}

    arrays = []
    node.create_subscription(DiagnosticArray, '/diagnostics', arrays.append, 10)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not any(len(a.status) == 4 for a in arrays):
        time.sleep(0.1)  # the client's spinner delivers them
    periodic = [a for a in arrays if len(a.status) == 4]
    assert periodic, 'no periodic /diagnostics from the launched node'
    statuses = {s.name: s for s in periodic[-1].status}
    assert all(s.hardware_id == HARDWARE_ID for s in statuses.values())
    engine = {kv.key: kv.value for kv in statuses['gemma_spec: engine'].values}
    assert engine['drafter'] == 'ngram' and engine['device'] == 'cpu' and engine['state'] == 'ready'
    period = {kv.key: kv.value for kv in statuses['gemma_spec: diagnostics period'].values}
    assert float(period['Target frequency (Hz)']) == pytest.approx(1 / PERIOD)


@pytest.mark.launch(fixture=orin_launch)
def test_log_level_reaches_the_node(ready):
    # log_level:=warn: the node prints the warning of an aborted goal, but none of its INFO lines
    outcome = ready.send(make_goal('x', temperature=9.0))
    assert outcome.status == 'aborted' and 'temperature' in outcome.result.error
    assert OUTPUT.wait_for('aborted: ', 30), OUTPUT.text[-2000:]
    node_lines = [line for line in OUTPUT.text.splitlines() if '.gemma_spec]' in line]  # logger robot1.gemma_spec
    assert any('[WARN]' in line and 'aborted' in line for line in node_lines), node_lines
    assert not [line for line in node_lines if '[INFO]' in line], node_lines  # e.g. 'ready in', 'loading engine'


@pytest.mark.launch(fixture=orin_launch, shutdown=True)
def test_shutdown_ends_the_node_cleanly():
    # launch_pytest shut the launch down: launch sent SIGINT to the node and waited for it
    assert OUTPUT.exit_codes and set(OUTPUT.exit_codes.values()) == {0}, (OUTPUT.exit_codes, OUTPUT.text[-2000:])
    assert 'escalating to' not in OUTPUT.text  # launch never had to fall back to SIGTERM / SIGKILL


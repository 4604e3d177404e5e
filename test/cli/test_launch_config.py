"""launch/orin.launch.py and config/orin.yaml: launch API when installed, else static checks; the YAML runs the node."""

import ast
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import NO_DIAGNOSTIC_UPDATER, TEST_COMPILE

pytest.importorskip('diagnostic_updater', reason=NO_DIAGNOSTIC_UPDATER)

import rclpy
import setuptools
import yaml
from rclpy.context import Context
from rclpy.parameter import Parameter

from gemma_spec_ros.ros.node import GemmaSpecNode

REPO = Path(__file__).resolve().parents[2]
LAUNCH_FILE = REPO / 'launch' / 'orin.launch.py'
CONFIG = REPO / 'config' / 'orin.yaml'
ARGUMENTS = {'params_file', 'namespace', 'log_level', 'autostart', 'device', 'drafter', 'backend', 'vllm_url'}
DOMAIN_ID = 11 + (os.getpid() + 67) % 80


def setup_kwargs():
    captured = {}
    original, cwd = setuptools.setup, os.getcwd()
    setuptools.setup = lambda **kwargs: captured.update(kwargs)
    try:
        os.chdir(REPO)
        exec(compile((REPO / 'setup.py').read_text(), 'setup.py', 'exec'), {'__name__': '__main__'})
    finally:
        os.chdir(cwd)
        setuptools.setup = original
    return captured


def yaml_parameters():
    document = yaml.safe_load(CONFIG.read_text())
    assert list(document) == ['/**'] and list(document['/**']) == ['ros__parameters']

    def flatten(prefix, value):
        if isinstance(value, dict):
            for key, inner in value.items():
                yield from flatten(prefix + key + '.', inner)
        else:
            yield prefix[:-1], value

    return dict(flatten('', document['/**']['ros__parameters']))


def calls(tree, name):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, 'id', getattr(node.func, 'attr', None)) == name:
            yield node


def keywords(call):
    return {k.arg: k.value for k in call.keywords}


def test_launch_file():
    try:  # the repository's launch/ folder is a namespace package here, so ask for the API itself
        from launch import LaunchDescription  # noqa: F401
        has_launch = True
    except ImportError:
        has_launch = False
    if has_launch:  # on a robot: the real launch API
        import importlib.util
        spec = importlib.util.spec_from_file_location('orin_launch', LAUNCH_FILE)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        description = module.generate_launch_description()
        declared = {a.name: a for a in description.entities if type(a).__name__ == 'DeclareLaunchArgument'}
        assert ARGUMENTS <= set(declared) and all(a.description for a in declared.values())
        return
    tree = ast.parse(LAUNCH_FILE.read_text())
    declared = {}
    for call in calls(tree, 'DeclareLaunchArgument'):
        declared[call.args[0].value] = keywords(call)
    assert set(declared) == ARGUMENTS
    for name, kwargs in declared.items():
        assert isinstance(kwargs.get('description'), ast.Constant) and kwargs['description'].value, name
    node_calls = [c for c in calls(tree, 'LifecycleNode') if 'executable' in keywords(c)]
    assert len(node_calls) == 1
    node_kwargs = {k: v.value for k, v in keywords(node_calls[0]).items() if isinstance(v, ast.Constant)}
    assert node_kwargs['package'] == 'gemma_spec_ros' and node_kwargs['name'] == 'gemma_spec'
    scripts = {entry.split('=')[0].strip(): entry.split('=')[1].strip()
               for entry in setup_kwargs()['entry_points']['console_scripts']}
    assert scripts[node_kwargs['executable']] == 'gemma_spec_ros.__main__:node_main'
    share_call = next(calls(tree, 'join'))
    assert [a.value for a in share_call.args[1:]] == ['config', 'orin.yaml']


def test_default_params_file_is_installed():
    assert CONFIG.exists()
    data_files = dict(setup_kwargs()['data_files'])
    assert 'config/orin.yaml' in data_files['share/gemma_spec_ros/config']
    assert 'launch/orin.launch.py' in data_files['share/gemma_spec_ros/launch']


def _no_engine(config):
    raise RuntimeError('this test loads no engine')


def test_every_yaml_key_is_a_declared_parameter_of_the_right_type():
    params = yaml_parameters()
    context = Context()
    rclpy.init(context=context, domain_id=DOMAIN_ID)
    try:
        # declaring with the YAML values as overrides checks names, types and ranges; no model is loaded
        node = GemmaSpecNode('gemma_spec_yaml', engine_factory=_no_engine, context=context,
                             parameter_overrides=[Parameter(k, value=v) for k, v in params.items()])
        try:
            undeclared = sorted(k for k in params if not node.has_parameter(k))
            assert not undeclared, 'keys in orin.yaml the node does not declare: {}'.format(undeclared)
            for key, value in params.items():
                assert node.get_parameter(key).value == value, key
            names = node.list_parameters([], 0).names
            described = {n for n in names if not node.describe_parameter(n).description}
            # declared without a description by rclpy and by diagnostic_updater's Updater (use_fqn: 4.x)
            assert described <= {'use_sim_time', 'diagnostic_updater.period', 'diagnostic_updater.use_fqn'}, described
        finally:
            node.destroy_node()
    finally:
        rclpy.try_shutdown(context=context)


def test_bad_parameters_stop_the_node_with_a_clear_error():
    env = dict(os.environ, ROS_DOMAIN_ID=str(DOMAIN_ID), ROS_AUTOMATIC_DISCOVERY_RANGE='LOCALHOST')
    for override, expected in (('queue.policy:=lifo', 'queue.policy must be one of fifo|preempt'),
                               ('queue.max_length:=99', 'queue.max_length'),
                               ('engine.drafter:=eagle', 'engine.drafter must be one of')):
        run = subprocess.run([sys.executable, '-m', 'gemma_spec_ros', 'node', '--ros-args', '--params-file',
                              str(CONFIG), '-p', override], env=env, capture_output=True, text=True, timeout=60)
        assert run.returncode == 2 and expected in run.stderr, run.stderr


def test_yaml_runs_the_node_on_cpu_with_client_and_diag_tools():
    env = dict(os.environ, ROS_DOMAIN_ID=str(DOMAIN_ID), ROS_AUTOMATIC_DISCOVERY_RANGE='LOCALHOST',
               PYTHONUNBUFFERED='1')
    node = subprocess.Popen([sys.executable, '-m', 'gemma_spec_ros', 'node', '--ros-args', '--params-file',
                             str(CONFIG), '-p', 'engine.device:=cpu', '-p', 'engine.num_threads:=1', '-p',
                             'engine.compile:=' + TEST_COMPILE],
                            env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        client = subprocess.run([sys.executable, '-m', 'gemma_spec_ros', 'client', 'def plan(robot):',
                                 '--max-new-tokens', '12', '--server-timeout', '60'],
                                env=env, capture_output=True, text=True, timeout=240)
        assert client.returncode == 0, client.stdout + client.stderr
        assert 'status: succeeded' in client.stdout and 'tau' in client.stdout
        cancelled = subprocess.run([sys.executable, '-m', 'gemma_spec_ros', 'client', 'def plan(robot):',
                                    '--max-new-tokens', '200', '--cancel-after', '3', '--drafter', 'none'],
                                   env=env, capture_output=True, text=True, timeout=120)
        assert cancelled.returncode == 0 and 'status: canceled' in cancelled.stdout, cancelled.stdout
        diag = subprocess.run([sys.executable, '-m', 'gemma_spec_ros', 'diag', '--once'], env=env,
                              capture_output=True, text=True, timeout=60)
        assert diag.returncode == 0, diag.stderr
        assert 'gemma_spec: engine' in diag.stdout and 'gemma4-spec-vision' in diag.stdout
    finally:
        node.send_signal(signal.SIGINT)
        output, _ = node.communicate(timeout=30)
    assert node.returncode == 0, output
    assert 'ready in' in output and 'gemma4-spec-vision' in output


def test_vllm_dev_launch_starts_the_server_and_a_node_with_backend_vllm():
    launch = pytest.importorskip('launch', reason='needs the launch API (the ROS 2 tools wheelhouse)')
    import importlib.util
    spec = importlib.util.spec_from_file_location('vllm_dev_launch', REPO / 'launch' / 'vllm_dev.launch.py')
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    description = module.generate_launch_description()
    context = launch.LaunchContext()
    declared = [a for a in description.entities if type(a).__name__ == 'DeclareLaunchArgument']
    assert {a.name for a in declared} == {'port', 'ngram', 'venv', 'setup', 'params_file', 'namespace', 'log_level'}
    context.launch_configurations.update({a.name: a.default_value[0].perform(context) for a in declared})
    context.launch_configurations.update(port='8123', ngram='0')
    server, node = module._server_and_node(context)
    command = [''.join(part.perform(context) for part in argument) for argument in server.cmd]
    assert command[1:] == ['-m', 'gemma_spec_ros.engine.backends.vllm_server', '--port', '8123', '--ngram', '0',
                           '--venv', str(module.DEFAULT_VENV)]
    assert type(node).__name__ == 'LifecycleNode'
    context.launch_configurations['setup'] = 'true'
    command = [''.join(part.perform(context) for part in argument) for argument in
               module._server_and_node(context)[0].cmd]
    assert command[:4] == ['bash', '-c', 'bash "$0" && exec "$@"', str(module.SETUP_SCRIPT)]
    assert module.SETUP_SCRIPT.exists()

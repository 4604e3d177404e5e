"""
Launch the gemma_spec node with the Jetson Orin parameters: ``ros2 launch gemma_spec_ros orin.launch.py``.

The node is a managed (lifecycle) node. autostart:=true (the default) configures and activates it as soon as it
runs; autostart:=false leaves it unconfigured for ``ros2 lifecycle set /gemma_spec configure`` and ``activate``
(or a lifecycle manager). respawn:=true starts the node again when its process dies (a crash, a kill, the OOM
killer) after respawn_delay seconds; with autostart it comes back serving, and clients see the lost goals end
(GenerateClient: status 'lost', send(retries=1) resends them).
"""

import os

from ament_index_python.packages import get_package_share_directory
from launch.actions import DeclareLaunchArgument, OpaqueFunction
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import LifecycleNode

from launch import LaunchDescription

# launch argument -> the parameter it overrides when not empty
OVERRIDES = {'device': 'engine.device', 'drafter': 'engine.drafter', 'compile': 'engine.compile',
             'warmup': 'engine.warmup', 'backend': 'engine.backend', 'vllm_url': 'vllm.url'}


def _node(context):
    overrides = {'lifecycle.autostart': LaunchConfiguration('autostart').perform(context) == 'true'}
    for argument, parameter in OVERRIDES.items():
        value = LaunchConfiguration(argument).perform(context)
        if value:
            overrides[parameter] = value
    enclave = LaunchConfiguration('enclave').perform(context)
    return [LifecycleNode(
        package='gemma_spec_ros',
        executable='gemma_spec_node',
        name='gemma_spec',
        namespace=LaunchConfiguration('namespace'),
        parameters=[LaunchConfiguration('params_file'), overrides],
        arguments=['--ros-args', '--log-level', LaunchConfiguration('log_level')],
        output='screen',
        emulate_tty=True,
        respawn=LaunchConfiguration('respawn').perform(context) == 'true',
        respawn_delay=float(LaunchConfiguration('respawn_delay').perform(context)),
        # rcl lets this variable win over --enclave; the launch process keeps its own (docs/security.md)
        additional_env={'ROS_SECURITY_ENCLAVE_OVERRIDE': enclave} if enclave else None,
    )]


def generate_launch_description():
    default_params = os.path.join(get_package_share_directory('gemma_spec_ros'), 'config', 'orin.yaml')
    return LaunchDescription([
        DeclareLaunchArgument('params_file', default_value=default_params,
                              description='node parameters (YAML with /**: ros__parameters:)'),
        DeclareLaunchArgument('namespace', default_value='',
                              description='namespace of the node (the action becomes <ns>/gemma_spec/generate)'),
        DeclareLaunchArgument('log_level', default_value='info', description='debug|info|warn|error'),
        DeclareLaunchArgument('autostart', default_value='true', choices=['true', 'false'],
                              description='configure and activate the managed node at once (false: wait for '
                                          '`ros2 lifecycle set`)'),
        DeclareLaunchArgument('respawn', default_value='false', choices=['true', 'false'],
                              description='start the node again when its process dies'),
        DeclareLaunchArgument('respawn_delay', default_value='2.0',
                              description='seconds between the death of the node and its new start'),
        DeclareLaunchArgument('device', default_value='',
                              description="override engine.device: auto|cpu|cuda ('' = keep the params file's)"),
        DeclareLaunchArgument('drafter', default_value='',
                              description='override engine.drafter: none|mtp|draft|ngram|lookahead|eagle3|auto '
                                          "('' = keep the file's)"),
        DeclareLaunchArgument('compile', default_value='',
                              description='override engine.compile: auto|inductor|inductor-gemm|cudagraph|eager|'
                                          "transformers ('' = keep the file's)"),
        DeclareLaunchArgument('warmup', default_value='',
                              description='override engine.warmup: background (serve at once on eager steps) | '
                                          "blocking (compile before serving) | off ('' = keep the file's)"),
        DeclareLaunchArgument('backend', default_value='',
                              description="override engine.backend: local|vllm ('' = keep the file's)"),
        DeclareLaunchArgument('vllm_url', default_value='',
                              description="override vllm.url, the vLLM server of backend vllm ('' = keep the file's)"),
        DeclareLaunchArgument('enclave', default_value='',
                              description="SROS2 enclave of the node, e.g. /gemma_spec ('' = none; "
                                          'config/sros2_policy.xml, docs/security.md)'),
        OpaqueFunction(function=_node),
    ])

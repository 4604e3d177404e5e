"""
The node's parameters, declared from EngineConfig's field metadata and the node-only table below.

queue.*, lifecycle.* and diagnostics.* belong to the node only; vllm.* come from VllmConfig and apply with
engine.backend vllm.
Imports no torch.
"""

import dataclasses

from rcl_interfaces.msg import FloatingPointRange, IntegerRange, ParameterDescriptor

from gemma_spec_ros.engine.backends.vllm import VllmConfig
from gemma_spec_ros.engine.config_checks import check_parameter
from gemma_spec_ros.engine.config_file import MODEL_PATH_FIELDS, resolve_model_path
from gemma_spec_ros.engine.types import INT32_MAX, EngineConfig, parameter_name

QUEUE_MAX_LENGTH_LIMIT = 16
QUEUE_POLICIES = ('fifo', 'preempt')
DEACTIVATE_POLICIES = ('finish', 'cancel')


@dataclasses.dataclass(frozen=True)
class NodeParameter:
    default: object
    description: str
    limits: tuple | None = None    # (min, max) for numbers
    choices: tuple | None = None   # allowed strings


NODE_PARAMETERS = {
    'lifecycle.autostart': NodeParameter(True, 'configure and activate once the node spins (false: wait for '
                                         '`ros2 lifecycle set`)'),
    'lifecycle.on_deactivate': NodeParameter('finish', 'what deactivate does to the running goal: finish it, or '
                                             'cancel it (its client gets the partial text)',
                                             choices=DEACTIVATE_POLICIES),
    'queue.max_length': NodeParameter(4, 'goals that may wait behind the running one; more end at once with '
                                      "finish_reason 'busy'", (0, QUEUE_MAX_LENGTH_LIMIT)),
    'queue.fair_claim': NodeParameter(2.0, 'seconds at least a client refused as busy keeps its claim on the next '
                                      'free slot (twice its usual gap between a busy result and its retry where '
                                      'that is longer, at most 30 s; fair admission by goal client_id; 0 = first '
                                      'come, first served)',
                                      (0.0, 600.0)),
    'queue.goal_timeout': NodeParameter(0.0, "seconds from acceptance after which a goal ends with finish_reason "
                                        "'timeout' and its partial text (0 = off)", (0.0, 86400.0)),
    'queue.abort_orphaned_goals': NodeParameter(True, 'abort a goal once every feedback/status subscriber present '
                                                'when it was accepted has left the ROS graph'),
    'queue.policy': NodeParameter('fifo', 'fifo: goals wait their turn; preempt: a new goal aborts the running and '
                                  'waiting ones (like nav2)', choices=QUEUE_POLICIES),
    'diagnostics.hardware_id': NodeParameter('none', 'hardware_id of the /diagnostics statuses'),
    'diagnostics.window': NodeParameter(32, 'goals in the rolling window of the /diagnostics figures', (1, 100000)),
    'diagnostics.ttft_budget': NodeParameter(2.0, 'WARN when the time-to-first-token p95 exceeds this (s, 0 = off)',
                                             (0.0, 3600.0)),
    'diagnostics.inter_token_latency_budget': NodeParameter(
        0.25, 'WARN when the inter-token latency p95 exceeds this (s, 0 = off)', (0.0, 3600.0)),
    'diagnostics.rss_budget_mb': NodeParameter(0.0, 'WARN when the process RSS exceeds this (MiB, 0 = off)',
                                               (0.0, 1e9)),
    'diagnostics.min_mem_available_mb': NodeParameter(
        512.0, 'WARN when system MemAvailable (unified memory on Jetson) drops below this (MiB, 0 = off)', (0.0, 1e9)),
    'diagnostics.cuda_reserved_budget_mb': NodeParameter(
        0.0, 'WARN when CUDA memory reserved exceeds this (MiB, 0 = off)', (0.0, 1e9)),
}


def _config_parameters(config_class) -> dict[str, tuple[str, NodeParameter, bool]]:
    """Parameter name ('<group>.<field>') -> (config field, its rule, changeable at run time)."""
    return {'{}.{}'.format(f.metadata['group'], f.name): (
        f.name, NodeParameter(f.default, f.metadata['description'], f.metadata['limits'], f.metadata['choices']),
        f.metadata['runtime']) for f in dataclasses.fields(config_class)}


CONFIG_PARAMETERS = _config_parameters(EngineConfig)
VLLM_PARAMETERS = _config_parameters(VllmConfig)
RUNTIME_ENGINE_PARAMETERS = tuple(name for name, (_, _, runtime) in CONFIG_PARAMETERS.items() if runtime)
# read at configure: set while unconfigured (they apply at the next configure), refused once configured
LOAD_TIME_PARAMETERS = tuple(name for name, (_, _, runtime) in (CONFIG_PARAMETERS | VLLM_PARAMETERS).items()
                             if not runtime)


def _rule(name: str) -> NodeParameter | None:
    for table in (CONFIG_PARAMETERS, VLLM_PARAMETERS):
        if name in table:
            return table[name][1]
    return NODE_PARAMETERS.get(name)


def _descriptor(rule: NodeParameter) -> ParameterDescriptor:
    descriptor = ParameterDescriptor(description=rule.description)
    if rule.limits is not None and isinstance(rule.default, float):
        descriptor.floating_point_range = [FloatingPointRange(from_value=float(rule.limits[0]),
                                                              to_value=float(rule.limits[1]))]
    elif rule.limits is not None:
        descriptor.integer_range = [IntegerRange(from_value=rule.limits[0], to_value=min(rule.limits[1], INT32_MAX),
                                                 step=1)]
    elif rule.choices is not None:
        descriptor.additional_constraints = 'one of: ' + ', '.join(rule.choices)
    return descriptor


def check(name: str, value) -> None:
    """Raise ValueError when a parameter value breaks its rule (choices or limits)."""
    rule = _rule(name)
    if rule is not None:
        check_parameter(name, value, rule.choices, rule.limits)


def declare(node) -> None:
    """
    Declare every parameter on node and check the values it was started with; ValueError when one is bad.

    None is read-only: the node refuses a change of a LOAD_TIME_PARAMETERS entry while it is configured.
    """
    for name, (_, rule, _) in (CONFIG_PARAMETERS | VLLM_PARAMETERS).items():
        node.declare_parameter(name, rule.default, _descriptor(rule))
    for name, rule in NODE_PARAMETERS.items():
        node.declare_parameter(name, rule.default, _descriptor(rule))
    for name in list(CONFIG_PARAMETERS) + list(VLLM_PARAMETERS) + list(NODE_PARAMETERS):
        check(name, node.get_parameter(name).value)


def engine_config(node) -> EngineConfig:
    """EngineConfig from the node's parameters, model paths resolved; ValueError when the target is missing."""
    values = {field: node.get_parameter(name).value for name, (field, _, _) in CONFIG_PARAMETERS.items()}
    if values['backend'] == 'local' and not values['target_path']:
        raise ValueError('parameter {} is required with engine.backend local (a Gemma 4 target directory)'.format(
            parameter_name('target_path')))
    for field in MODEL_PATH_FIELDS:
        if values[field] and values['backend'] == 'local':
            values[field] = resolve_model_path(values[field])
    return EngineConfig(**values)


def vllm_config(node) -> VllmConfig:
    """VllmConfig from the node's vllm.* parameters."""
    return VllmConfig(**{field: node.get_parameter(name).value for name, (field, _, _) in VLLM_PARAMETERS.items()})


def usage_lines() -> list[str]:
    """One line per parameter for --help."""
    lines = ['  {:<41} {}'.format(name, rule.description)
             for name, (_, rule, _) in (CONFIG_PARAMETERS | VLLM_PARAMETERS).items()]
    lines += ['  {:<41} {} (default {!r})'.format(name, rule.description, rule.default)
              for name, rule in NODE_PARAMETERS.items()]
    return lines

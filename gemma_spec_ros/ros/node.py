"""
ROS 2 node ``gemma_spec``: the action ``~/generate`` and /diagnostics around a backend (engine.backend).

The node only adapts ROS to the Backend interface: parameters come from the engine config (parameters.py), the
action and its worker live in goal_server.py (goals pass a ROS-free queue, goal_queue.py), messages are converted
in conversions.py, and failures end goals with the reason in ``result.error``.

With engine.backend vllm the engine is a VllmBackend: the vLLM server at vllm.url serves the goals, nothing loads
here (ready at once, even while the server is down), and a server fault aborts the goal with its partial text.
"""

import threading
import time

from rcl_interfaces.msg import SetParametersResult
from rclpy.node import Node

from gemma_spec_ros.engine.backend import open_backend
from gemma_spec_ros.ros import diagnostics, parameters
from gemma_spec_ros.ros.goal_queue import GoalQueue
from gemma_spec_ros.ros.goal_server import GoalServer
from gemma_spec_ros.ros.parameters import QUEUE_MAX_LENGTH_LIMIT

NODE_NAME = 'gemma_spec'
EXECUTOR_THREADS = QUEUE_MAX_LENGTH_LIMIT + 6  # every admitted goal's execute callback holds a thread

__all__ = ['GemmaSpecNode', 'QUEUE_MAX_LENGTH_LIMIT']


class GemmaSpecNode(Node):
    """Generate action server over the speculative-decoding engine, with /diagnostics."""

    def __init__(self, node_name=NODE_NAME, engine_factory=None, **kwargs):
        super().__init__(node_name, **kwargs)
        self._engine_factory = engine_factory
        parameters.declare(self)
        self._queue = GoalQueue(self._param('queue.max_length'), self._param('queue.policy'),
                                self._param('queue.fair_claim'))
        self._backend = None
        self._metrics = diagnostics.GenerationMetrics(self._param('diagnostics.window'))
        self._load_started = time.monotonic()
        self._load_progress = ''  # the latest loading step the engine reported

        self._updater = diagnostics.Updater(self)
        self._updater.setHardwareID(self._param('diagnostics.hardware_id'))
        self._updater.add('engine', self._engine_task)
        self._updater.add('generation', self._generation_task)
        self._updater.add('memory', self._memory_task)
        self._updater.add(diagnostics.PeriodStatus(self._updater.period))
        self.add_on_set_parameters_callback(self._on_set_parameters)

        self._goals = GoalServer(self, self._queue, self._metrics, lambda: self._backend)
        threading.Thread(target=self._open_backend, name='gemma_spec_loader', daemon=True).start()

    @property
    def state(self):
        """loading|ready|failed|shutdown."""
        return self._queue.state

    @property
    def backend(self):
        """The Backend serving the goals (engine.backend); None until it is open."""
        return self._backend

    def resolve_action_name(self):
        return '{}/{}/generate'.format(self.get_namespace().rstrip('/'), self.get_name())

    # ---- parameters --------------------------------------------------------------------------

    def _param(self, name):
        return self.get_parameter(name).value

    def _on_set_parameters(self, changed):
        try:
            for parameter in changed:
                parameters.check(parameter.name, parameter.value)
            engine_changes = [p for p in changed if p.name in parameters.RUNTIME_ENGINE_PARAMETERS]
            if engine_changes and self._backend is None:
                raise ValueError('engine is not loaded ({}); cannot change {}'.format(
                    self.state, ', '.join(p.name for p in engine_changes)))
            for parameter in engine_changes:
                if parameter.name == 'engine.drafter':
                    self._backend.set_default_drafter(parameter.value)
                else:
                    self._backend.set_default_num_draft_tokens(parameter.value)
                self.get_logger().info('{} set to {!r}'.format(parameter.name, parameter.value))
        except ValueError as error:
            return SetParametersResult(successful=False, reason=str(error))
        for parameter in changed:
            if parameter.name == 'diagnostics.hardware_id':
                self._updater.setHardwareID(parameter.value)
            elif parameter.name == 'diagnostics.window':
                self._metrics.resize(parameter.value)
            elif parameter.name == 'queue.max_length':
                self._queue.max_waiting = parameter.value
            elif parameter.name == 'queue.policy':
                self._queue.policy = parameter.value
            elif parameter.name == 'queue.fair_claim':
                self._queue.fair_claim = parameter.value
        return SetParametersResult(successful=True)

    def engine_config(self):
        """EngineConfig from the parameters, model paths resolved."""
        return parameters.engine_config(self)

    # ---- engine loading ----------------------------------------------------------------------

    def _open_backend(self):
        logger = self.get_logger()
        try:
            config = self.engine_config()
            if config.backend == 'local':
                logger.info('loading engine: target {} drafter {} device {}'.format(
                    config.target_path, config.drafter, config.device))
            if self._engine_factory is not None:
                backend = self._engine_factory(config)
            else:
                backend = open_backend(config, parameters.vllm_config(self), progress=self._report_progress)
        except Exception as error:  # noqa: BLE001 (any load failure is reported, the node stays up)
            reason = 'engine failed to load: {}'.format(error)
            logger.error(reason)
            self._queue.set_failed(reason)
            return
        for warning in backend.warnings:
            logger.error(warning)
        self._backend = backend
        if self._queue.set_ready():
            logger.info('ready in {:.1f} s: action {} served by {}'.format(
                time.monotonic() - self._load_started, self.resolve_action_name(), backend.describe()))

    def _report_progress(self, message):
        """Log a loading or warm-up step; while loading it also goes to /diagnostics."""
        self._load_progress = str(message)
        self.get_logger().info(self._load_progress)

    # ---- diagnostics -------------------------------------------------------------------------

    def _engine_task(self, stat):
        backend = self._backend  # status() of a server backend asks the server over HTTP: never under a lock
        return diagnostics.fill_engine_status(
            stat, self.state, self._queue.reason, backend.status() if backend is not None else None, self._metrics,
            loading_seconds=time.monotonic() - self._load_started, progress=self._load_progress)

    def _generation_task(self, stat):
        queued, running = self._queue.depth()
        return diagnostics.fill_generation_status(
            stat, self._metrics, queued, running, queue_limit=self._queue.limit,
            ttft_budget=self._param('diagnostics.ttft_budget'),
            inter_token_latency_budget=self._param('diagnostics.inter_token_latency_budget'))

    def _memory_task(self, stat):
        device = self._backend.device if self._backend is not None else 'cpu'
        return diagnostics.fill_memory_status(
            stat, diagnostics.read_memory(device),
            rss_budget_mb=self._param('diagnostics.rss_budget_mb'),
            min_mem_available_mb=self._param('diagnostics.min_mem_available_mb'),
            cuda_reserved_budget_mb=self._param('diagnostics.cuda_reserved_budget_mb'))

    # ---- shutdown ----------------------------------------------------------------------------

    def shutdown(self, timeout=5.0):
        """Stop serving: abort waiting goals, cancel the running one, wait for their results; end the warm-up."""
        if self._backend is not None:
            self._backend.close()
        self._goals.shutdown(timeout)

    def destroy_node(self):
        self.shutdown()
        self._goals.destroy()
        return super().destroy_node()

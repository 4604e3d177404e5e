"""
ROS 2 node ``gemma_spec``: a managed (lifecycle) node serving the action ``~/generate`` over a backend.

The node only adapts ROS to the Backend interface: parameters come from the engine config (parameters.py), the
action and its workers live in goal_server.py (goals pass a ROS-free queue, goal_queue.py), messages are converted
in conversions.py, and failures end goals with the reason in ``result.error``.

Lifecycle (a ROS 2 managed node): configure opens the backend (loads the models, starts the warm-up), activate
serves goals (as many at once as the backend's Capabilities.max_concurrent_goals), deactivate refuses new goals
(running ones finish, or are cancelled with lifecycle.on_deactivate cancel), cleanup lets go of the backend and its
memory, shutdown ends everything from any state. A fault that leaves the backend unable to serve (out of memory on
the device) takes the node through error processing, which cleans up. With lifecycle.autostart (the default) the
node configures and activates itself once it spins.
/diagnostics publish in every state.
"""

import threading
import time

from rcl_interfaces.msg import SetParametersResult
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup
from rclpy.lifecycle import LifecycleNode, LifecycleNodeMixin, TransitionCallbackReturn
from rclpy.node import Node

from gemma_spec_ros.engine.backend import release_memory
from gemma_spec_ros.engine.factory import open_backend
from gemma_spec_ros.engine.stats import mib, process_rss_bytes
from gemma_spec_ros.ros import diagnostics, parameters
from gemma_spec_ros.ros.goal_queue import MAX_RUNNING_LIMIT, GoalQueue
from gemma_spec_ros.ros.goal_server import GoalServer
from gemma_spec_ros.ros.parameters import QUEUE_MAX_LENGTH_LIMIT

NODE_NAME = 'gemma_spec'
# every admitted goal's execute callback holds a thread (running and waiting ones), and 5 serve everything else
EXECUTOR_THREADS = MAX_RUNNING_LIMIT + QUEUE_MAX_LENGTH_LIMIT + 5
INACTIVE_REASON = 'node {} is inactive (lifecycle): goals are refused until it is activated'
CLEANED_UP_REASON = 'node {} was cleaned up (lifecycle): configure and activate it to serve again'

__all__ = ['GemmaSpecNode', 'QUEUE_MAX_LENGTH_LIMIT']


class GemmaSpecNode(LifecycleNode):
    """Generate action server over a backend, with /diagnostics; a managed node."""

    def __init__(self, node_name=NODE_NAME, engine_factory=None, **kwargs):
        """engine_factory(config) -> Backend: opens the backend at configure instead of open_backend (tests)."""
        Node.__init__(self, node_name, **kwargs)
        # the lifecycle services and autostart in a group of their own: one transition at a time, and /diagnostics
        # (the default group) keep publishing while configure loads the models
        self._transitions = MutuallyExclusiveCallbackGroup()
        LifecycleNodeMixin.__init__(self, callback_group=self._transitions)
        self._engine_factory = engine_factory
        parameters.declare(self)
        self._queue = GoalQueue(self._param('queue.max_length'), self._param('queue.policy'),
                                self._param('queue.fair_claim'))
        self._backend = None
        self._fault = ''  # why the backend can no longer serve: the next transition goes to error processing
        self._fault_lock = threading.Lock()  # concurrent goals' workers may report faults at once
        self._lifecycle = 'unconfigured'  # the state each transition callback leaves the node in
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

        self._goals = GoalServer(self, self._queue, self._metrics, lambda: self._backend, on_fault=self._on_fault)
        if self._param('lifecycle.autostart'):
            self._queue.set_loading()  # goals sent before the executor spins wait for the configure that follows
            self._autostart_timer = self.create_timer(0.0, self._autostart, callback_group=self._transitions)

    @property
    def state(self):
        """The serving state: unconfigured|loading|inactive|ready|failed|shutdown."""
        return self._queue.state

    @property
    def lifecycle_state(self) -> str:
        """unconfigured|inactive|active|finalized, or the transition under way (configuring, ...)."""
        return self._lifecycle

    @property
    def backend(self):
        """The Backend serving the goals (engine.backend); None while unconfigured."""
        return self._backend

    def resolve_action_name(self):
        return '{}/{}/generate'.format(self.get_namespace().rstrip('/'), self.get_name())

    # ---- lifecycle ---------------------------------------------------------------------------

    def _autostart(self):
        self.destroy_timer(self._autostart_timer)
        if self.trigger_configure() == TransitionCallbackReturn.SUCCESS:
            self.trigger_activate()

    def on_configure(self, state) -> TransitionCallbackReturn:
        """Read the parameters and open the backend (load the models); FAILURE with the reason logged."""
        logger = self.get_logger()
        self._lifecycle = 'configuring'
        self._queue.set_loading()
        self._load_started, self._load_progress, self._fault = time.monotonic(), '', ''
        rss_before = process_rss_bytes()
        try:
            config = parameters.engine_config(self)
            if config.backend == 'local':
                logger.info('loading engine: target {} drafter {} device {}'.format(
                    config.target_path, config.drafter, config.device))
            if self._engine_factory is not None:
                backend = self._engine_factory(config)
            else:
                backend = open_backend(config, parameters.vllm_config(self), progress=self._report_progress)
        except Exception as error:  # noqa: BLE001 (any load failure fails the transition; the node stays up)
            reason = 'engine failed to load (configure failed): {}'.format(error)
            logger.error(reason)
            self._queue.set_failed(reason)
            self._lifecycle = 'unconfigured'
            return TransitionCallbackReturn.FAILURE
        for warning in backend.warnings:
            logger.error(warning)
        self._backend = backend
        slots = self._goals.set_max_running(backend.capabilities.max_concurrent_goals)
        logger.info('configured in {:.1f} s: {}, {} goal(s) at once (process RSS {:.0f} -> {:.0f} MiB)'.format(
            time.monotonic() - self._load_started, backend.describe(), slots, mib(rss_before),
            mib(process_rss_bytes())))
        self._queue.set_configured(INACTIVE_REASON.format(self.get_fully_qualified_name()))
        self._lifecycle = 'inactive'
        return TransitionCallbackReturn.SUCCESS

    def on_activate(self, state) -> TransitionCallbackReturn:
        if self._queue.set_ready():
            self.get_logger().info('ready in {:.1f} s: action {} served by {}'.format(
                time.monotonic() - self._load_started, self.resolve_action_name(), self._backend.describe()))
        self._lifecycle = 'active'
        return super().on_activate(state)

    def on_deactivate(self, state) -> TransitionCallbackReturn:
        cancel = self._param('lifecycle.on_deactivate') == 'cancel' or bool(self._fault)
        self._queue.set_inactive(INACTIVE_REASON.format(self.get_fully_qualified_name()), cancel_running=cancel)
        if self._fault:
            return TransitionCallbackReturn.ERROR  # to error processing: on_error cleans up
        self.get_logger().info('inactive: new goals are refused; running goals {}'.format(
            'are cancelled' if cancel else 'finish'))
        self._lifecycle = 'inactive'
        return super().on_deactivate(state)

    def on_cleanup(self, state) -> TransitionCallbackReturn:
        self._release_backend('node failed: {}'.format(self._fault) if self._fault else
                              CLEANED_UP_REASON.format(self.get_fully_qualified_name()))
        self._lifecycle = 'unconfigured'
        return TransitionCallbackReturn.SUCCESS

    def on_shutdown(self, state) -> TransitionCallbackReturn:
        self.shutdown()
        self._release_backend('node is shutting down')
        self._lifecycle = 'finalized'
        return TransitionCallbackReturn.SUCCESS

    def on_error(self, state) -> TransitionCallbackReturn:
        self.get_logger().error('error processing after {}: cleaning up'.format(self._fault or 'a failed transition'))
        self._release_backend('node failed: {}'.format(self._fault or 'a transition failed'))
        self._lifecycle = 'unconfigured'
        return TransitionCallbackReturn.SUCCESS

    def _on_fault(self, reason: str) -> None:
        """Leave the active state through error processing: the backend cannot serve any more (a worker thread)."""
        with self._fault_lock:  # one timer for the first fault: _process_fault destroys the one it knows
            if self._fault:
                return
            self._fault = reason
            self._fault_timer = self.create_timer(0.0, self._process_fault, callback_group=self._transitions)
        self.get_logger().error('{}: the node goes to error processing'.format(reason))

    def _process_fault(self):
        self.destroy_timer(self._fault_timer)
        if self.lifecycle_state == 'active':
            self.trigger_deactivate()  # its callback returns ERROR: error processing cleans up
        elif self.lifecycle_state == 'inactive':  # a goal that finished after deactivate: no error transition left
            self.trigger_cleanup()

    def _release_backend(self, reason: str) -> None:
        """End every goal with reason, close the backend and let go of it; log the process memory freed."""
        self._queue.set_unconfigured(reason)
        self._goals.wait_until_idle()
        backend, self._backend = self._backend, None
        if backend is None:
            return
        device = backend.device
        before = diagnostics.read_memory(device)
        backend.close()
        del backend
        release_memory()
        after = diagnostics.read_memory(device)
        cuda = ', CUDA reserved {:.0f} -> {:.0f} MiB'.format(
            mib(before['cuda_reserved']), mib(after['cuda_reserved'])) if 'cuda_reserved' in before else ''
        self.get_logger().info('backend released: process RSS {:.0f} -> {:.0f} MiB{}'.format(
            mib(before['VmRSS']), mib(after['VmRSS']), cuda))

    # ---- parameters --------------------------------------------------------------------------

    def _param(self, name):
        return self.get_parameter(name).value

    def _on_set_parameters(self, changed):
        try:
            for parameter in changed:
                parameters.check(parameter.name, parameter.value)
            configured = self._backend is not None or self.state == 'loading'
            fixed = [p.name for p in changed if p.name in parameters.LOAD_TIME_PARAMETERS]
            if fixed and configured:
                raise ValueError('{} is read at configure and the node is {}: clean it up (ros2 lifecycle set {} '
                                 'cleanup), set it, and configure again'.format(
                                     ', '.join(fixed), self.lifecycle_state, self.get_fully_qualified_name()))
            for parameter in changed:
                if parameter.name in parameters.RUNTIME_ENGINE_PARAMETERS and self._backend is not None:
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

    def _report_progress(self, message):
        """Log a loading or warm-up step; while loading it also goes to /diagnostics."""
        self._load_progress = str(message)
        self.get_logger().info(self._load_progress)

    # ---- diagnostics -------------------------------------------------------------------------

    def _engine_task(self, stat):
        backend = self._backend  # status() of a server backend asks the server over HTTP: never under a lock
        diagnostics.fill_engine_status(
            stat, self.state, self._queue.reason, backend.status() if backend is not None else None, self._metrics,
            loading_seconds=time.monotonic() - self._load_started, progress=self._load_progress)
        stat.add('lifecycle', self.lifecycle_state)
        if backend is not None:
            stat.add('images', diagnostics.describe_images(backend.capabilities))
        return stat

    def _generation_task(self, stat):
        queued, running = self._queue.depth()
        return diagnostics.fill_generation_status(
            stat, self._metrics, queued, running, queue_limit=self._queue.limit, max_running=self._queue.max_running,
            ttft_budget=self._param('diagnostics.ttft_budget'),
            inter_token_latency_budget=self._param('diagnostics.inter_token_latency_budget'))

    def _memory_task(self, stat):
        device = self._backend.device if self._backend is not None else 'cpu'
        diagnostics.fill_memory_status(
            stat, diagnostics.read_memory(device),
            rss_budget_mb=self._param('diagnostics.rss_budget_mb'),
            min_mem_available_mb=self._param('diagnostics.min_mem_available_mb'),
            cuda_reserved_budget_mb=self._param('diagnostics.cuda_reserved_budget_mb'))
        stat.add('heap trims when idle', str(self._goals.idle_trims))  # goal_server.IDLE_TRIM_INTERVAL
        return stat

    # ---- shutdown ----------------------------------------------------------------------------

    def shutdown(self, timeout=5.0):
        """Stop serving: abort waiting goals, cancel the running ones, wait for their results; end the warm-up."""
        if self._backend is not None:
            self._backend.close()
        self._goals.shutdown(timeout)

    def destroy_node(self):
        self.shutdown()
        self._goals.destroy()
        return super().destroy_node()

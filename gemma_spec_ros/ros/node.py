"""
ROS 2 node ``gemma_spec``: the action ``~/generate`` and /diagnostics around the speculative engine.

The node only adapts ROS to the engine: parameters come from the engine config (parameters.py), goals go through
a ROS-free queue (goal_queue.py) to one worker thread, messages are converted in conversions.py, and failures end
goals with the reason in ``result.error``. Every goal is accepted: a full queue ends it at once as busy. A timer
ends goals past queue.goal_timeout and goals whose every possible receiver (the action's feedback and status
subscribers at acceptance) left the ROS graph.

With engine.backend vllm the engine is a VllmBackend: the vLLM server at vllm.url serves the goals, nothing loads
here (ready at once, even while the server is down), and a server fault aborts the goal with its partial text.
"""

import signal
import sys
import threading
import time
import traceback

import rclpy
from gemma_spec_msgs.action import Generate
from rcl_interfaces.msg import SetParametersResult
from rclpy.action import ActionServer, CancelResponse
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup, ReentrantCallbackGroup
from rclpy.executors import MultiThreadedExecutor
from rclpy.node import Node
from rclpy.qos import QoSProfile
from rclpy.signals import SignalHandlerOptions
from rclpy.utilities import remove_ros_args

from gemma_spec_ros.engine.backend import open_backend
from gemma_spec_ros.engine.vllm_backend import SERVER_WIDE_WARNING
from gemma_spec_ros.ros import diagnostics, parameters
from gemma_spec_ros.ros.conversions import delta_to_feedback, goal_to_request, result_to_msg
from gemma_spec_ros.ros.goal_queue import ORPHANED_REASON, GoalQueue, Job
from gemma_spec_ros.ros.parameters import QUEUE_MAX_LENGTH_LIMIT

NODE_NAME = 'gemma_spec'
FEEDBACK_QUEUE_DEPTH = 1000  # KEEP_LAST depth for feedback: one message per round; a slower reader loses the oldest
CANCEL_STATE_TIMEOUT = 2.0   # seconds to wait for rclpy to mark a cancelled goal CANCELING
EXECUTOR_THREADS = QUEUE_MAX_LENGTH_LIMIT + 6  # every admitted goal's execute callback holds a thread
RESULT_TIMEOUT = 60.0  # seconds a finished goal's result is kept (rclpy: 900); bounds what busy goals hold
SUPERVISE_PERIOD = 0.25  # seconds between checks for goals past queue.goal_timeout or without a receiver
ABORT_OUTCOMES = {'busy': 'busy', 'timeout': 'timed out'}  # finish_reason -> diagnostics outcome

__all__ = ['GemmaSpecNode', 'QUEUE_MAX_LENGTH_LIMIT', 'main']


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

        self._action_server = ActionServer(
            self, Generate, '~/generate',
            execute_callback=self.execute_callback,
            cancel_callback=self.cancel_callback,
            handle_accepted_callback=self.handle_accepted_callback,
            callback_group=ReentrantCallbackGroup(),
            feedback_pub_qos_profile=QoSProfile(depth=FEEDBACK_QUEUE_DEPTH),
            result_timeout=RESULT_TIMEOUT)
        action = self.resolve_action_name()
        self._receiver_topics = (action + '/_action/feedback', action + '/_action/status')
        self.create_timer(SUPERVISE_PERIOD, self._supervise, callback_group=MutuallyExclusiveCallbackGroup())
        self._worker = threading.Thread(target=self._work, name='gemma_spec_worker', daemon=True)
        self._worker.start()
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

    # ---- action callbacks --------------------------------------------------------------------

    def handle_accepted_callback(self, goal_handle):
        """Validate the goal (when the engine is ready) and admit it; an invalid or busy goal ends at once."""
        request, plan, invalid = self._plan(goal_handle.request)
        job = self._queue.register(_key(goal_handle), goal_handle, goal_handle.request.client_id,
                                   self._receivers(), invalid=invalid)
        job.request, job.plan = request, plan
        if job.finish_reason == 'busy':
            self.get_logger().info('goal {} of client {!r}: {}'.format(
                _short_id(goal_handle), job.client, job.error))
        goal_handle.execute()

    def cancel_callback(self, goal_handle):
        """Accept every cancel: a waiting goal leaves the queue, the running one stops within a round."""
        self._queue.cancel(_key(goal_handle))
        return CancelResponse.ACCEPT

    def execute_callback(self, goal_handle):
        key = _key(goal_handle)
        job = self._queue.job(key)
        try:
            self._queue.enqueue(job)
            job.done.wait()
            return self._complete(job, goal_handle)
        finally:
            self._queue.release(key)

    def _plan(self, goal):
        """(request, plan, error): validated now when the engine is ready, so that a bad goal never waits."""
        try:
            request = goal_to_request(goal)
            return request, self._backend.validate(request) if self._backend is not None else None, ''
        except ValueError as error:
            return None, None, str(error)

    def _receivers(self) -> set:
        """Graph endpoints that may receive goal results now: the action's feedback and status subscribers."""
        if not self._param('queue.abort_orphaned_goals'):
            return set()
        return {bytes(info.endpoint_gid) for topic in self._receiver_topics
                for info in self.get_subscriptions_info_by_topic(topic)}

    def _supervise(self):
        """End goals past queue.goal_timeout and goals nobody can receive any more (they end within a round)."""
        timeout = self._param('queue.goal_timeout')
        if timeout > 0:
            self._queue.expire(timeout)
        if self._param('queue.abort_orphaned_goals'):
            self._queue.drop_orphans(self._receivers())

    def _complete(self, job: Job, goal_handle) -> Generate.Result:
        """Set the goal's terminal state and build its result."""
        engine_finish = job.result.finish_reason if job.result is not None else ''
        if job.result is not None:
            for warning in job.result.warnings:  # a vLLM server's overlapping requests are normal: debug
                log = self.get_logger().debug if warning == SERVER_WIDE_WARNING else self.get_logger().warning
                log('goal {}: {}'.format(_short_id(goal_handle), warning))
        if job.client_cancelled and engine_finish in ('cancelled', ''):
            result = result_to_msg(job.result, finish_reason='cancelled')
            deadline = time.monotonic() + CANCEL_STATE_TIMEOUT
            while not goal_handle.is_cancel_requested and time.monotonic() < deadline:
                time.sleep(0.001)
            goal_handle.canceled()
            outcome = 'cancelled'
        elif job.error:
            finish_reason = job.finish_reason or (
                'cancelled' if job.preempted or engine_finish == 'cancelled' else 'error')
            result = result_to_msg(job.result, error=job.error, finish_reason=finish_reason)
            goal_handle.abort()
            outcome = 'orphaned' if job.error == ORPHANED_REASON else ABORT_OUTCOMES.get(finish_reason, 'aborted')
            if outcome != 'busy':
                self.get_logger().warning('goal {} aborted: {}'.format(_short_id(goal_handle), job.error))
        else:
            result = result_to_msg(job.result)
            goal_handle.succeed()
            outcome = 'succeeded'
        self._metrics.record(outcome, job.result, job.feedback_times, job.accepted_at)
        return result

    # ---- worker ------------------------------------------------------------------------------

    def _work(self):
        while (job := self._queue.take()) is not None:
            try:
                self._generate(job)
            finally:
                self._queue.finished(job)

    def _generate(self, job: Job):
        def on_delta(delta):
            job.feedback_times.append((time.monotonic(), len(delta.token_ids)))
            job.handle.publish_feedback(delta_to_feedback(delta))

        job.feedback_times.append((time.monotonic(), 0))
        try:
            plan = job.plan if job.plan is not None else self._backend.validate(job.request)
            job.result = self._backend.generate(plan, on_delta=on_delta, cancel=job.cancel)
            if job.result.finish_reason == 'error':  # a server backend's fault: abort with the partial text
                job.error = job.result.error
        except ValueError as error:
            job.error = str(error)
        except Exception as error:  # noqa: BLE001 (the goal is aborted, the node keeps serving)
            job.error = 'engine error: {}: {}'.format(type(error).__name__, error)
            self.get_logger().error('goal {}: {}\n{}'.format(job.key.hex()[:8], job.error, traceback.format_exc()))

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
        self._queue.shutdown()
        if self._backend is not None:
            self._backend.close()
        deadline = time.monotonic() + timeout
        self._queue.wait_until_released(timeout)
        self._worker.join(max(0.0, deadline - time.monotonic()))

    def destroy_node(self):
        self.shutdown()
        self._action_server.destroy()
        return super().destroy_node()


def _key(goal_handle) -> bytes:
    return bytes(goal_handle.goal_id.uuid)


def _short_id(goal_handle) -> str:
    return _key(goal_handle).hex()[:8]


def main(argv=None) -> int:
    """Run the node until SIGINT/SIGTERM: ``python -m gemma_spec_ros node --ros-args ...``."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(arg in ('-h', '--help') for arg in remove_ros_args(['gemma_spec_node'] + argv)[1:]):
        print('usage: python -m gemma_spec_ros node [--ros-args --params-file config/orin.yaml '
              '-p engine.device:=cpu ...]\n\nParameters:')
        print('\n'.join(parameters.usage_lines()))
        print('  {:<41} {}'.format(diagnostics.PERIOD_PARAMETER, 'seconds between /diagnostics updates'))
        return 0
    rclpy.init(args=['gemma_spec_node'] + argv, signal_handler_options=SignalHandlerOptions.NO)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    try:
        node = GemmaSpecNode()
    except Exception as error:  # noqa: BLE001 (bad parameters: a clear message, exit code 2)
        print('gemma_spec_node: invalid parameters: {}'.format(error), file=sys.stderr)
        rclpy.try_shutdown()
        return 2
    executor = MultiThreadedExecutor(num_threads=EXECUTOR_THREADS)
    executor.add_node(node)
    stopper, stopped_at = None, None
    while rclpy.ok():
        executor.spin_once(timeout_sec=0.1)
        if stop.is_set() and stopper is None:
            node.get_logger().info('shutting down')
            stopper = threading.Thread(target=node.shutdown)  # keeps spinning so the last results go out
            stopper.start()
        if stopper is not None and not stopper.is_alive():
            stopped_at = stopped_at or time.monotonic()
            if time.monotonic() - stopped_at > 0.3:
                break
    executor.shutdown(timeout_sec=1.0)
    node.destroy_node()
    rclpy.try_shutdown()
    return 0


if __name__ == '__main__':
    sys.exit(main())

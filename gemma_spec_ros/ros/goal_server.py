"""
The action ``~/generate`` of the node: goals in, through the goal queue and its worker threads, to the backend.

Every goal is accepted: an invalid one ends at once with the reason, a full queue ends it as busy. One worker thread
per running slot (the backend's ``Capabilities.max_concurrent_goals``, set with ``set_max_running``) takes goals from
the queue, runs each on the backend (``generate`` blocks, so each concurrent goal needs a thread of its own) and
streams its text as feedback. A timer ends goals past queue.goal_timeout and goals whose every possible receiver
(the action's feedback and status subscribers at acceptance) left the ROS graph. When the last running goal ends
and none waits, the worker gives the C heap's freed pages back to the OS (malloc_trim, at most once per
IDLE_TRIM_INTERVAL): glibc keeps what the goals' threads freed resident in each thread's arena, a level that a soak
saw creep up as rarer peaks came by.
"""

import threading
import time
import traceback
from collections.abc import Callable

from gemma_spec_msgs.action import Generate
from rclpy.action import ActionServer, CancelResponse
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup, ReentrantCallbackGroup
from rclpy.qos import QoSProfile, ReliabilityPolicy

from gemma_spec_ros.engine.backend import Backend, is_fatal_error, return_freed_memory
from gemma_spec_ros.engine.types import WarningKind, parameter_name
from gemma_spec_ros.ros.conversions import ImageLimits, delta_to_feedback, goal_to_request, result_to_msg
from gemma_spec_ros.ros.diagnostics import GenerationMetrics
from gemma_spec_ros.ros.goal_queue import ORPHANED_REASON, GoalQueue, Job

FEEDBACK_QUEUE_DEPTH = 1000  # KEEP_LAST depth for feedback: one message per round; a slower reader loses the oldest
# KEEP_LAST depth of the goal, result and cancel services' request queues. ROS's default (10) drops requests when
# more clients than that send at once (a flood of 20 planners lost goal requests, and their clients never heard
# back); every request must reach the queue, which answers each (busy when full).
SERVICE_QUEUE_DEPTH = 1000
CANCEL_STATE_TIMEOUT = 2.0   # seconds to wait for rclpy to mark a cancelled goal CANCELING
# seconds a finished goal's result is kept (rclpy: 900); clients ask for it as soon as the goal is accepted. Every
# status message lists each kept goal and every action client decodes each message, so under a flood of busy goals
# a long keep slows every client's round trip
RESULT_TIMEOUT = 10.0
SUPERVISE_PERIOD = 0.25  # seconds between checks for goals past queue.goal_timeout or without a receiver
ABORT_OUTCOMES = {'busy': 'busy', 'timeout': 'timed out'}  # finish_reason -> diagnostics outcome
IDLE_TRIM_INTERVAL = 30.0  # s: the most often an idle node returns freed heap to the OS (a trim takes milliseconds)


class GoalServer:
    """The Generate action server of a node, serving goals with the backend backend() returns."""

    def __init__(self, node, queue: GoalQueue, metrics: GenerationMetrics, backend: Callable[[], Backend | None],
                 on_fault: Callable[[str], None] = lambda reason: None):
        """on_fault(reason): called from a worker when the backend failed so that it cannot serve any more."""
        self._node = node
        self._on_fault = on_fault
        self._queue = queue
        self._metrics = metrics
        self._backend = backend
        self._logger = node.get_logger()
        services = QoSProfile(depth=SERVICE_QUEUE_DEPTH, reliability=ReliabilityPolicy.RELIABLE)
        self._action_server = ActionServer(
            node, Generate, '~/generate',
            execute_callback=self.execute_callback,
            cancel_callback=self.cancel_callback,
            handle_accepted_callback=self.handle_accepted_callback,
            callback_group=ReentrantCallbackGroup(),
            feedback_pub_qos_profile=QoSProfile(depth=FEEDBACK_QUEUE_DEPTH),
            goal_service_qos_profile=services, result_service_qos_profile=services, cancel_service_qos_profile=services,
            result_timeout=RESULT_TIMEOUT)
        action = node.resolve_action_name()
        self._receiver_topics = (action + '/_action/feedback', action + '/_action/status')
        node.create_timer(SUPERVISE_PERIOD, self._supervise, callback_group=MutuallyExclusiveCallbackGroup())
        self._workers: list[threading.Thread] = []
        self._workers_lock = threading.Lock()
        self._trim_lock = threading.Lock()
        self._trimmed_at = time.monotonic()
        self.idle_trims = 0  # malloc_trim calls when the node went idle
        self.set_max_running(queue.max_running)

    def _param(self, name):
        return self._node.get_parameter(name).value

    def set_max_running(self, slots: int) -> int:
        """Run up to slots goals at once on the backend; return the number set (GoalQueue.set_max_running)."""
        slots = self._queue.set_max_running(slots)
        with self._workers_lock:
            # workers are never stopped: with fewer slots later the spare ones wait in take() until shutdown
            while len(self._workers) < slots:
                worker = threading.Thread(target=self._work, name='gemma_spec_worker_{}'.format(len(self._workers)),
                                          daemon=True)
                worker.start()
                self._workers.append(worker)
        return slots

    def handle_accepted_callback(self, goal_handle):
        """Validate the goal (when the engine is ready) and admit it; an invalid or busy goal ends at once."""
        request, plan, invalid = self._plan(goal_handle.request)
        job = self._queue.register(_key(goal_handle), goal_handle, goal_handle.request.client_id,
                                   self._receivers(), invalid=invalid)
        job.request, job.plan = request, plan
        if job.finish_reason == 'busy':
            self._logger.info('goal {} of client {!r}: {}'.format(
                _short_id(goal_handle), job.client, job.error))
        goal_handle.execute()

    def cancel_callback(self, goal_handle):
        """Accept every cancel: a waiting goal leaves the queue, a running one stops within a round."""
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
        backend = self._backend()
        try:
            limits = ImageLimits(self._param(parameter_name('max_images_per_goal')),
                                 self._param(parameter_name('max_image_pixels')))
            request = goal_to_request(goal, limits)
            return request, backend.validate(request) if backend is not None else None, ''
        except ValueError as error:
            return None, None, str(error)

    def _receivers(self) -> set:
        """Graph endpoints that may receive goal results now: the action's feedback and status subscribers."""
        if not self._param('queue.abort_orphaned_goals'):
            return set()
        return {bytes(info.endpoint_gid) for topic in self._receiver_topics
                for info in self._node.get_subscriptions_info_by_topic(topic)}

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
                server_wide = getattr(warning, 'kind', None) is WarningKind.SERVER_WIDE_FIGURES
                log = self._logger.debug if server_wide else self._logger.warning
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
                self._logger.warning('goal {} aborted: {}'.format(_short_id(goal_handle), job.error))
        else:
            result = result_to_msg(job.result)
            goal_handle.succeed()
            outcome = 'succeeded'
        self._metrics.record(outcome, job.result, job.feedback_times, job.accepted_at)
        return result

    def _work(self):
        while (job := self._queue.take()) is not None:
            try:
                self._generate(job)
            finally:
                self._queue.finished(job)
            self._trim_when_idle()

    def _trim_when_idle(self) -> None:
        """Return the heap's freed pages to the OS once no goal runs or waits (at most every IDLE_TRIM_INTERVAL)."""
        if time.monotonic() - self._trimmed_at < IDLE_TRIM_INTERVAL or self._queue.depth() != (0, 0) or \
                not self._trim_lock.acquire(blocking=False):
            return
        try:
            self._trimmed_at = time.monotonic()
            return_freed_memory()  # ctypes lets go of the GIL: a goal arriving meanwhile is accepted at once
            self.idle_trims += 1
        finally:
            self._trim_lock.release()

    def _generate(self, job: Job):
        def on_delta(delta):
            job.feedback_times.append((time.monotonic(), len(delta.token_ids)))
            job.handle.publish_feedback(delta_to_feedback(delta))

        job.feedback_times.append((time.monotonic(), 0))
        try:
            backend = self._backend()
            if backend is None:  # let go of (cleanup) after this goal was taken
                job.error = self._queue.reason or 'node is not configured'
                return
            plan = job.plan if job.plan is not None else backend.validate(job.request)
            job.result = backend.generate(plan, on_delta=on_delta, cancel=job.cancel)
            if job.result.finish_reason == 'error':  # a server backend's fault: abort with the partial text
                job.error = job.result.error
        except ValueError as error:
            job.error = str(error)
        except Exception as error:  # noqa: BLE001 (the goal is aborted, the node keeps serving)
            job.error = 'engine error: {}: {}'.format(type(error).__name__, error)
            self._logger.error('goal {}: {}\n{}'.format(job.key.hex()[:8], job.error, traceback.format_exc()))
            if is_fatal_error(error):
                self._on_fault(job.error)

    def shutdown(self, timeout: float = 5.0) -> None:
        """Abort waiting goals, cancel the running ones and wait until every goal has its result."""
        self._queue.shutdown()
        deadline = time.monotonic() + timeout
        self._queue.wait_until_released(timeout)
        with self._workers_lock:
            workers = list(self._workers)
        for worker in workers:
            worker.join(max(0.0, deadline - time.monotonic()))

    def wait_until_idle(self, timeout: float = 30.0) -> bool:
        """Wait until no goal runs (after the queue stopped serving); False on timeout."""
        return self._queue.wait_until_idle(timeout)

    def destroy(self) -> None:
        self._action_server.destroy()


def _key(goal_handle) -> bytes:
    return bytes(goal_handle.goal_id.uuid)


def _short_id(goal_handle) -> str:
    return _key(goal_handle).hex()[:8]

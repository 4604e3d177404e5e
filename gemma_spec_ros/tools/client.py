"""
A planner's client of the node: GenerateClient, goals (make_goal) and their messages, /diagnostics listening.

``GenerateClient`` sends Generate goals from any thread (several at once) and streams their feedback; the demo,
record / replay, the stress tool, the tests and the ``client`` command (client_cli.py) use it.
"""

import copy
import io
import json
import threading
import time
import uuid
from dataclasses import dataclass, field

import rclpy
from action_msgs.msg import GoalStatus
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus
from gemma_spec_msgs.action import Generate
from gemma_spec_msgs.msg import ChatMessage, ToolCall
from PIL import Image as PilImage
from rclpy.action import ActionClient
from rclpy.executors import SingleThreadedExecutor
from rclpy.qos import QoSProfile, ReliabilityPolicy
from sensor_msgs.msg import CompressedImage, Image
from unique_identifier_msgs.msg import UUID

DEFAULT_ACTION = '/gemma_spec/generate'
FEEDBACK_QUEUE_DEPTH = 1000
SERVICE_QUEUE_DEPTH = 1000   # KEEP_LAST depth of the action's service replies (see GenerateClient)
FEEDBACK_SETTLE = 1.0   # seconds to wait for feedback still in flight when the result arrives
STATUS_NAMES = {GoalStatus.STATUS_SUCCEEDED: 'succeeded', GoalStatus.STATUS_ABORTED: 'aborted',
                GoalStatus.STATUS_CANCELED: 'canceled'}
LEVEL_NAMES = {DiagnosticStatus.OK: 'OK', DiagnosticStatus.WARN: 'WARN', DiagnosticStatus.ERROR: 'ERROR',
               DiagnosticStatus.STALE: 'STALE'}


@dataclass
class Outcome:
    """What happened to one goal, as the client saw it."""

    accepted: bool = False
    status: str = 'rejected'          # succeeded|aborted|canceled|rejected|timeout|lost (the server went away)
    result: object = None             # Generate.Result
    feedback: list = field(default_factory=list)        # Generate.Feedback messages in arrival order
    feedback_times: list = field(default_factory=list)  # seconds after sending, per feedback message
    result_time: float = 0.0          # seconds from sending to the result
    cancel_time: float = 0.0          # seconds after sending when the cancel was requested (0 = never)
    attempts: int = 1                 # goals sent: more than 1 where send(retries=...) resent a lost goal

    @property
    def busy(self) -> bool:
        """The node was full: the goal ended at once with finish_reason 'busy' (retry later)."""
        return self.status == 'aborted' and self.result.finish_reason == 'busy'

    @property
    def first_feedback_latency(self) -> float:
        return self.feedback_times[0] if self.feedback_times else 0.0

    @property
    def streamed_text(self) -> str:
        return ''.join(f.text_delta for f in self.feedback)

    @property
    def fully_streamed(self) -> bool:
        """The feedback carried the whole result: its text and its tokens (a reply with calls may have no text)."""
        return self.streamed_text == self.result.text and \
            sum(len(f.token_ids_delta) for f in self.feedback) >= len(self.result.token_ids)

    @property
    def streamed_reasoning(self) -> str:
        return ''.join(f.reasoning_delta for f in self.feedback)

    @property
    def streamed_tool_calls(self) -> list:
        """The tool calls the feedback carried (gemma_spec_msgs/ToolCall), in the order they completed."""
        return [call for f in self.feedback for call in f.tool_calls_delta]

    @property
    def cancel_latency(self) -> float:
        """Seconds from the cancel request to the result (0 when not cancelled)."""
        return self.result_time - self.cancel_time if self.cancel_time else 0.0


def make_goal(prompt='', messages=(), max_new_tokens=0, temperature=0.0, top_p=0.0, top_k=0, stop=(),
              seed=-1, drafter='', num_draft_tokens=0, client_id='', json_schema='', grammar='',
              json_free_whitespace=False, images=(), compressed_images=(), tools='', tool_choice='',
              parallel_tool_calls=True, thinking=False, max_thinking_tokens=0,
              json_schema_unenforced='') -> Generate.Goal:
    """
    Build a Generate goal; json_schema and grammar are text.

    messages: (role, content) or (role, content, image_indices) tuples, ChatMessage messages, or dicts with the keys
    role, content and optionally image_indices (or images), tool_calls and name; image_indices count images, then
    compressed_images (sensor_msgs messages: image_from_file, compressed_image_from_file). An assistant dict's
    tool_calls are {id, name, arguments} dicts (arguments: JSON text or a dict) or ToolCall messages, e.g. a result's
    tool_calls as they came; a tool dict's name is the tool whose result its content is (a dict content is sent as
    JSON). tools: JSON text of a list of tools, or the list itself.
    """
    return Generate.Goal(prompt=prompt, messages=[chat_message(m) for m in messages],
                         max_new_tokens=int(max_new_tokens), temperature=float(temperature), top_p=float(top_p),
                         top_k=int(top_k), stop=list(stop), seed=int(seed), drafter=drafter,
                         num_draft_tokens=int(num_draft_tokens), client_id=client_id, json_schema=json_schema,
                         grammar=grammar, json_free_whitespace=bool(json_free_whitespace), images=list(images),
                         compressed_images=list(compressed_images), tools=tools_text(tools),
                         tool_choice=tool_choice, parallel_tool_calls=bool(parallel_tool_calls),
                         thinking=bool(thinking), max_thinking_tokens=int(max_thinking_tokens),
                         json_schema_unenforced=json_schema_unenforced)


def tools_text(tools) -> str:
    """Return tools as the goal's JSON text: a string as it is, a list of tool dicts as JSON."""
    return tools if isinstance(tools, str) else json.dumps(list(tools))


def chat_message(message) -> ChatMessage:
    """Return a ChatMessage of a (role, content[, image_indices]) tuple, a dict (see make_goal) or a ChatMessage."""
    if isinstance(message, ChatMessage):
        return message
    if not isinstance(message, dict):
        return _chat_message(*message)
    content = message.get('content', '')
    return _chat_message(message['role'], content if isinstance(content, str) else json.dumps(content),
                         message.get('image_indices', message.get('images', ())),
                         message.get('tool_calls', ()), message.get('name', ''))


def _chat_message(role, content, image_indices=(), tool_calls=(), name='') -> ChatMessage:
    return ChatMessage(role=role, content=content, image_indices=[int(index) for index in image_indices],
                       tool_calls=[tool_call(call) for call in tool_calls], name=name)


def tool_call(call) -> ToolCall:
    """Return a ToolCall message of a {id, name, arguments} dict (arguments: JSON text or a dict) or a ToolCall."""
    if isinstance(call, ToolCall):
        return call
    if not isinstance(call, dict):   # the engine's ToolCall, or a message of another package with the same fields
        return ToolCall(id=call.id, name=call.name, arguments=call.arguments)
    arguments = call.get('arguments', '{}')
    return ToolCall(id=call.get('id', ''), name=call['name'],
                    arguments=arguments if isinstance(arguments, str) else json.dumps(arguments))


def compressed_image_from_file(path) -> CompressedImage:
    """Return a PNG or JPEG file as a sensor_msgs/CompressedImage, its bytes as they are; ValueError otherwise."""
    with open(path, 'rb') as stream:
        data = stream.read()
    image_format = _image_format(path, data)
    return CompressedImage(format=image_format, data=data)


def image_from_file(path) -> Image:
    """Return a PNG or JPEG file decoded to a sensor_msgs/Image, encoding rgb8 (what a camera driver publishes)."""
    with open(path, 'rb') as stream:
        data = stream.read()
    _image_format(path, data)
    with PilImage.open(io.BytesIO(data)) as decoded:
        rgb = decoded.convert('RGB')
    return Image(width=rgb.width, height=rgb.height, encoding='rgb8', step=3 * rgb.width, data=rgb.tobytes())


def _image_format(path, data: bytes) -> str:
    """'png' or 'jpeg', read from the file's header; ValueError naming the file otherwise."""
    try:
        with PilImage.open(io.BytesIO(data)) as decoded:
            found = decoded.format
    except (OSError, SyntaxError) as error:
        raise ValueError('{}: not a readable image ({})'.format(path, error)) from error
    if found not in ('PNG', 'JPEG'):
        raise ValueError('{}: a {} image; goals take png or jpeg files'.format(path, found))
    return found.lower()


def level_name(level) -> str:
    """'OK', 'WARN', 'ERROR' or 'STALE' for a level given as bytes (message field) or int."""
    key = bytes([level]) if isinstance(level, int) else bytes(level)
    return LEVEL_NAMES.get(key, repr(level))


class BackgroundSpinner:
    """Spins an executor on a daemon thread until stop() (which joins it before the executor is shut down)."""

    def __init__(self, node, executor=None):
        self._executor = executor or SingleThreadedExecutor(context=node.context)
        self._executor.add_node(node)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._spin, daemon=True)
        self._thread.start()

    @property
    def executor(self):
        return self._executor

    def _spin(self):
        while not self._stop.is_set() and self._executor.context.ok():
            self._executor.spin_once(timeout_sec=0.05)

    def stop(self):
        self._stop.set()
        self._thread.join()
        self._executor.shutdown(timeout_sec=1.0)


class DiagnosticsListener:
    """Keeps the latest status of each name on /diagnostics whose node prefix matches."""

    def __init__(self, node, node_name='gemma_spec'):
        self._prefix = node_name + ': ' if node_name else ''
        self._lock = threading.Condition()
        self._latest = {}   # status name -> (level name, message, {key: value}, monotonic time)
        self._arrays = 0
        self._subscription = node.create_subscription(
            DiagnosticArray, '/diagnostics', self._on_array, QoSProfile(depth=10))

    def _on_array(self, array):
        now = time.monotonic()
        with self._lock:
            matched = False
            for status in array.status:
                if status.name.startswith(self._prefix):
                    values = {kv.key: kv.value for kv in status.values}
                    self._latest[status.name] = (level_name(status.level), status.message, values, now)
                    matched = True
            if matched:
                self._arrays += 1
                self._lock.notify_all()

    def wait(self, predicate=None, timeout=10.0):
        """Wait until predicate(latest) holds (or any sample arrives); return latest, or None on timeout."""
        deadline = time.monotonic() + timeout
        with self._lock:
            start = self._arrays
            while True:
                if predicate is None and self._arrays > start:
                    return dict(self._latest)
                if predicate is not None and self._latest and predicate(self._latest):
                    return dict(self._latest)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._lock.wait(remaining)

    def latest(self):
        with self._lock:
            return dict(self._latest)


def _progress(loading_message: str) -> str:
    """Return what a loading message says was done, without its running clock ('loading models (12 s): ...')."""
    return loading_message.split(': ', 1)[1] if ': ' in loading_message else ''


def engine_state(latest, node_name='gemma_spec'):
    """Return (state, message) of the node's engine status: loading|ready|failed|shutdown, or None."""
    entry = latest.get('{}: engine'.format(node_name))
    return (entry[2].get('state'), entry[1]) if entry else (None, '')


class GenerateClient:
    """
    An ActionClient for Generate with its own node, spun on a background thread.

    Feedback comes through a subscription of its own to the action's feedback topic: rclpy's ActionClient drops
    the feedback callback of a goal as soon as its result arrives, and with it feedback still in flight (seen under
    load: the streamed text then misses its last rounds). send() waits up to feedback_settle seconds for that feedback
    (many clients in one process, each receiving every goal's feedback, need longer under load: stress).
    """

    def __init__(self, action_name=DEFAULT_ACTION, node_name='gemma_spec_client', context=None,
                 feedback_settle: float = FEEDBACK_SETTLE):
        self._node = rclpy.create_node(node_name, context=context)
        self._feedback_settle = feedback_settle
        self._action_name = self._node.resolve_topic_name(action_name)
        # the services' replies to every client of the action arrive at each client, which keeps its own: with
        # ROS's default depth (10) a burst of other clients' replies pushed out this one's (a flood of 20 planners)
        services = QoSProfile(depth=SERVICE_QUEUE_DEPTH, reliability=ReliabilityPolicy.RELIABLE)
        self._client = ActionClient(self._node, Generate, action_name,
                                    feedback_sub_qos_profile=QoSProfile(depth=FEEDBACK_QUEUE_DEPTH),
                                    goal_service_qos_profile=services, result_service_qos_profile=services,
                                    cancel_service_qos_profile=services)
        self._feedback_handlers = {}   # goal id bytes -> callback(Generate.Feedback)
        self._node.create_subscription(Generate.Impl.FeedbackMessage, action_name + '/_action/feedback',
                                       self._on_feedback, QoSProfile(depth=FEEDBACK_QUEUE_DEPTH))
        self._diagnostics = None
        self._closed = False   # close() ran: a cancel timer that fires later does nothing
        self._spinner = BackgroundSpinner(self._node)

    def _on_feedback(self, message):
        handler = self._feedback_handlers.get(bytes(message.goal_id.uuid))
        if handler is not None:
            handler(message.feedback)

    @property
    def node(self):
        return self._node

    def wait_for_server(self, timeout=30.0) -> bool:
        return self._client.wait_for_server(timeout_sec=timeout)

    def wait_until_ready(self, node_name='gemma_spec', timeout=120.0, on_progress=None):
        """
        Wait until the node's /diagnostics say the engine is ready, as long as its loading makes progress.

        timeout: seconds without progress (a new loading message, such as a compile warm-up step) before giving
        up. on_progress(message) sees each new loading message. RuntimeError if the node failed or stalled.
        """
        seen = None

        def ready_or_progress(latest):
            state, message = engine_state(latest, node_name)
            return state in ('ready', 'failed') or (state == 'loading' and _progress(message) != seen)

        while True:
            latest = self.diagnostics_sample(node_name, timeout, ready_or_progress)
            if latest is None:
                raise RuntimeError('node {} made no loading progress on /diagnostics for {} s{}'.format(
                    node_name, timeout, ' (last: {})'.format(seen) if seen else ''))
            state, message = engine_state(latest, node_name)
            if state == 'ready':
                return latest
            if state != 'loading':
                raise RuntimeError('node {} is not serving: {}'.format(node_name, message))
            seen = _progress(message)
            if on_progress is not None:
                on_progress(message)

    def diagnostics_sample(self, node_name='gemma_spec', timeout=10.0, predicate=None):
        """
        Return the node's /diagnostics statuses, {name: (level, message, values, time)}; None on timeout.

        Without a predicate: the next sample. With one: the latest statuses that satisfy predicate(statuses).
        """
        if self._diagnostics is None:
            self._diagnostics = DiagnosticsListener(self._node, node_name)
        return self._diagnostics.wait(predicate, timeout=timeout)

    def send(self, goal, on_feedback=None, cancel_after_tokens=0, cancel_after_seconds=0.0,
             timeout=600.0, retries=0, server_timeout=60.0) -> Outcome:
        """
        Send one goal and wait for its result; optionally cancel after N tokens or seconds.

        A goal without client_id is sent as this client's node name (fair admission between clients).

        When the action server leaves the ROS graph while the goal runs (the node was killed; ROS sees that within
        the DDS lease), the outcome is 'lost' instead of a wait until timeout. retries: send a lost goal again, as
        a new goal, that many times, each once a server is back within server_timeout (e.g. launch respawned the
        node); the outcome is the last attempt's, and outcome.attempts counts the goals sent (on_feedback saw the
        feedback of every attempt).
        """
        outcome = self._send_once(goal, on_feedback, cancel_after_tokens, cancel_after_seconds, timeout)
        for attempt in range(retries):
            if outcome.status != 'lost' or not self.wait_for_server(server_timeout):
                break
            outcome = self._send_once(goal, on_feedback, cancel_after_tokens, cancel_after_seconds, timeout)
            outcome.attempts = attempt + 2
        return outcome

    def _send_once(self, goal, on_feedback, cancel_after_tokens, cancel_after_seconds, timeout) -> Outcome:
        if not goal.client_id:
            goal = copy.copy(goal)
            goal.client_id = self._node.get_fully_qualified_name()
        outcome = Outcome()
        lock = threading.Lock()
        state = {'handle': None, 'cancel': False}
        start = time.monotonic()

        def request_cancel():
            with lock:
                if outcome.cancel_time or self._closed:
                    return
                handle = state['handle']
                if handle is None:
                    state['cancel'] = True
                    return
                outcome.cancel_time = time.monotonic() - start
            self._in_executor(handle.cancel_goal_async)   # on the spinning thread, as every ActionClient call

        def feedback_callback(feedback):
            outcome.feedback_times.append(time.monotonic() - start)
            outcome.feedback.append(feedback)
            if on_feedback is not None:
                on_feedback(feedback)
            if cancel_after_tokens and feedback.tokens_generated >= cancel_after_tokens:
                request_cancel()

        goal_id = UUID(uuid=list(uuid.uuid4().bytes))
        self._feedback_handlers[bytes(goal_id.uuid)] = feedback_callback
        try:
            servers = self._servers()
            alive = (lambda: bool(servers & self._servers())) if servers else None   # none known: wait as asked
            sent = _wait(self._in_executor(self._client.send_goal_async, goal, goal_uuid=goal_id), timeout, alive)
            if sent is None or sent is LOST:   # identity: a goal handle's == compares goal ids
                outcome.status = 'timeout' if sent is None else 'lost'
                return outcome
            if not sent.accepted:
                return outcome
            outcome.accepted = True
            with lock:
                state['handle'] = sent
                pending_cancel = state['cancel']
            timer = None
            if pending_cancel:
                request_cancel()
            elif cancel_after_seconds > 0:
                timer = threading.Timer(cancel_after_seconds, request_cancel)
                timer.start()
            response = _wait(self._in_executor(sent.get_result_async), timeout, alive)
            if timer is not None:
                timer.cancel()
            outcome.result_time = time.monotonic() - start
            if response is None or response is LOST:
                outcome.status = 'timeout' if response is None else 'lost'
                return outcome
            outcome.status = STATUS_NAMES.get(response.status, 'unknown')
            outcome.result = response.result
            settle = time.monotonic() + self._feedback_settle
            while not outcome.fully_streamed and time.monotonic() < settle:
                time.sleep(0.005)
            return outcome
        finally:
            del self._feedback_handlers[bytes(goal_id.uuid)]

    def _servers(self) -> set:
        """
        Return the ids (GIDs) of the action servers' status publishers in the ROS graph now.

        A goal is lost when every server seen as it was sent has left the graph. Names cannot tell: a node that
        launch respawned has the same ones, and knows nothing of the goal.
        """
        topic = self._action_name + '/_action/status'
        return {bytes(info.endpoint_gid) for info in self._node.get_publishers_info_by_topic(topic)}

    def _in_executor(self, function, *args, **kwargs):
        """
        Call an ActionClient method on the spinning thread; return the rclpy Future it returns.

        rclpy registers a pending request only after sending it, so a call from another thread can miss a fast
        response ('Ignoring unexpected goal response'); on the executor's own thread it cannot.
        """
        outer = self._spinner.executor.create_task(function, *args, **kwargs)
        return _ResultOfTask(outer)

    def close(self):
        self._closed = True
        self._spinner.stop()
        self._client.destroy()
        self._node.destroy_node()


class _ResultOfTask:
    """The future returned by the future that a task returns."""

    def __init__(self, outer):
        self._outer = outer

    def add_done_callback(self, callback):
        self._outer.add_done_callback(lambda outer: outer.result().add_done_callback(callback))

    def result(self):
        return self._outer.result().result()


LOST = object()      # what _wait returns when the server left the graph
LOST_AFTER = 1.0     # seconds the server must stay out of the graph to count as gone (discovery can flicker)


def _wait(future, timeout, server_is_ready=None):
    """Return the future's result; None after timeout; LOST once server_is_ready() stays False LOST_AFTER s."""
    done = threading.Event()
    future.add_done_callback(lambda _: done.set())
    deadline = time.monotonic() + timeout
    missing_since = None
    while not done.wait(min(0.25, max(deadline - time.monotonic(), 0.0))):
        now = time.monotonic()
        if now >= deadline:
            return None
        if server_is_ready is not None and not server_is_ready():
            missing_since = missing_since or now
            if now - missing_since >= LOST_AFTER:
                return LOST
        else:
            missing_since = None
    return future.result()

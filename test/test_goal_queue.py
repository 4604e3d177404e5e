"""The node's goal queue without ROS: admission, FIFO, preemption, early cancels, engine failure and shutdown."""

import threading

from gemma_spec_ros.ros.goal_queue import PREEMPTED_REASON, SHUTDOWN_REASON, GoalQueue


def accept(queue, key):
    assert queue.admit() == ''
    return queue.register(key)


def test_fifo_order_and_busy_admission():
    queue = GoalQueue(max_waiting=1)
    queue.set_ready()
    first, second = accept(queue, b'1'), accept(queue, b'2')
    refusal = queue.admit()
    assert refusal.startswith('busy') and 'queue.max_length 1' in refusal
    queue.enqueue(first)
    queue.enqueue(second)
    assert queue.take() is first and queue.depth() == (1, True)
    queue.finished(first)
    queue.release(b'1')
    assert first.done.is_set() and queue.admit() == ''   # the finished goal freed its slot
    assert queue.take() is second


def test_goals_wait_while_the_engine_loads():
    queue = GoalQueue()
    job = accept(queue, b'a')
    queue.enqueue(job)
    taken = []
    worker = threading.Thread(target=lambda: taken.append(queue.take()))
    worker.start()
    worker.join(0.2)
    assert worker.is_alive() and not taken
    queue.set_ready()
    worker.join(5)
    assert taken == [job]


def test_engine_failure_ends_waiting_and_new_goals():
    queue = GoalQueue()
    waiting = accept(queue, b'a')
    queue.enqueue(waiting)
    queue.set_failed('engine failed to load: no model')
    assert waiting.done.is_set() and waiting.error == 'engine failed to load: no model'
    late = accept(queue, b'b')
    queue.enqueue(late)
    assert late.done.is_set() and late.error == 'engine failed to load: no model'
    assert not queue.set_ready()


def test_cancel_before_the_goal_is_registered():
    queue = GoalQueue()
    queue.set_ready()
    assert queue.admit() == ''
    queue.cancel(b'x')                      # the cancel overtook handle_accepted
    job = queue.register(b'x')
    assert job.client_cancelled and job.cancel.cancelled
    queue.enqueue(job)
    assert job.done.is_set() and job.error == '' and queue.depth() == (0, False)


def test_cancel_of_a_waiting_goal_leaves_the_queue():
    queue = GoalQueue()
    queue.set_ready()
    running, waiting = accept(queue, b'1'), accept(queue, b'2')
    queue.enqueue(running)
    queue.enqueue(waiting)
    assert queue.take() is running
    queue.cancel(b'2')
    assert waiting.done.is_set() and waiting.client_cancelled and queue.depth() == (0, True)
    queue.cancel(b'1')
    assert running.cancel.cancelled and not running.done.is_set()  # the worker ends it within a round


def test_preempt_aborts_running_and_waiting_goals():
    queue = GoalQueue(policy='preempt')
    queue.set_ready()
    running, waiting, newest = accept(queue, b'1'), accept(queue, b'2'), accept(queue, b'3')
    queue.enqueue(running)
    assert queue.take() is running
    queue.enqueue(waiting)
    queue.enqueue(newest)
    assert running.preempted and running.cancel.cancelled and running.error == PREEMPTED_REASON
    assert waiting.done.is_set() and waiting.error == PREEMPTED_REASON
    assert queue.take() is newest and not newest.preempted


def test_shutdown_ends_everything_and_refuses_new_goals():
    queue = GoalQueue()
    queue.set_ready()
    running, waiting = accept(queue, b'1'), accept(queue, b'2')
    queue.enqueue(running)
    queue.enqueue(waiting)
    assert queue.take() is running
    queue.shutdown()
    assert waiting.done.is_set() and waiting.error == SHUTDOWN_REASON
    assert running.cancel.cancelled and running.error == SHUTDOWN_REASON
    assert queue.admit() == SHUTDOWN_REASON and queue.take() is None
    assert not queue.wait_until_released(0.05)   # both execute callbacks still hold their slots
    queue.release(b'1')
    queue.release(b'2')
    assert queue.wait_until_released(1.0)

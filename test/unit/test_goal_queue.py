"""The node's goal queue without ROS: admission, FIFO, preemption, early cancels, engine failure and shutdown."""

import threading

from gemma_spec_ros.ros.goal_queue import (
    LISTENER_GRACE,
    ORPHANED_REASON,
    PREEMPTED_REASON,
    SHUTDOWN_REASON,
    GoalQueue,
)


def accept(queue, key, client='', **kwargs):
    job = queue.register(key, client=client, **kwargs)
    assert job.admitted and not job.done.is_set()
    return job


def ready_queue(**kwargs) -> GoalQueue:
    """Return a queue whose node is active, so that goals are admitted or refused as busy."""
    queue = GoalQueue(**kwargs)
    queue.set_loading()
    queue.set_ready()
    return queue


def test_fifo_order_and_busy_admission():
    queue = GoalQueue(max_waiting=1)
    queue.set_loading()
    queue.set_ready()
    first, second = accept(queue, b'1'), accept(queue, b'2')
    busy = queue.register(b'3')
    assert busy.done.is_set() and not busy.admitted and busy.finish_reason == 'busy'
    assert busy.error.startswith('busy: 2 of 2 slots taken') and 'queue.max_length 1' in busy.error
    queue.release(b'3')
    queue.enqueue(first)
    queue.enqueue(second)
    assert queue.take() is first and queue.depth() == (1, True)
    queue.finished(first)
    queue.release(b'1')
    assert first.done.is_set() and accept(queue, b'4')   # the finished goal freed its slot
    assert queue.take() is second


def test_invalid_goal_takes_no_slot():
    queue = GoalQueue(max_waiting=0)
    queue.set_loading()
    queue.set_ready()
    bad = queue.register(b'x', invalid='temperature must be ...')
    assert bad.done.is_set() and bad.error == 'temperature must be ...' and not bad.admitted
    accept(queue, b'1')


def test_busy_clients_claim_free_slots_in_turn():
    queue = GoalQueue(max_waiting=0, fair_claim=5.0)
    queue.set_loading()
    queue.set_ready()
    accept(queue, b'a1', 'a', now=0.0)
    assert queue.register(b'b1', client='b', now=0.1).finish_reason == 'busy'
    assert queue.register(b'c1', client='c', now=0.2).finish_reason == 'busy'
    queue.release(b'a1')                                   # a's goal finished: one slot free
    again = queue.register(b'a2', client='a', now=0.3)     # a comes straight back, behind b and c's claims
    assert again.finish_reason == 'busy' and 'held for 2 client(s) refused earlier' in again.error
    assert queue.register(b'c2', client='c', now=0.4).finish_reason == 'busy'   # b claimed first
    accept(queue, b'b2', 'b', now=0.5)
    queue.release(b'b2')
    accept(queue, b'c3', 'c', now=0.6)
    queue.release(b'c3')
    accept(queue, b'a3', 'a', now=0.7)
    queue.release(b'a3')
    assert queue.register(b'b3', client='b', now=0.8).admitted   # no claims left: first come


def test_claims_expire():
    queue = GoalQueue(max_waiting=1, fair_claim=1.0)
    queue.set_loading()
    queue.set_ready()
    accept(queue, b'1', 'a', now=0.0)
    accept(queue, b'2', 'a', now=0.0)
    assert queue.register(b'3', client='b', now=0.1).finish_reason == 'busy'
    queue.release(b'2')
    assert queue.register(b'4', client='a', now=0.2).finish_reason == 'busy'   # b's claim holds the slot
    assert accept(queue, b'5', 'a', now=1.5)                                   # b did not come back in time


def test_a_client_that_retries_slowly_keeps_its_claim_for_twice_its_usual_gap():
    # a loaded client hears it was busy and retries 1.5 s later each time: a fixed 1 s claim lapses before every
    # retry and a client that just got its result takes the slot ahead of it
    queue = ready_queue(max_waiting=0, fair_claim=1.0)
    accept(queue, b'a1', 'a', now=0.0)
    assert queue.register(b'b1', client='b', now=0.1).finish_reason == 'busy'
    assert queue.register(b'b2', client='b', now=1.6).finish_reason == 'busy'   # its usual gap is 1.5 s now
    queue.release(b'a1')
    assert queue.register(b'a2', client='a', now=3.5).finish_reason == 'busy'   # b's claim lives 3 s after 1.6
    assert accept(queue, b'b3', 'b', now=3.6)


def test_a_claim_lives_at_most_max_claim_life():
    queue = ready_queue(max_waiting=0, fair_claim=1.0)
    accept(queue, b'a1', 'a', now=0.0)
    assert queue.register(b'b1', client='b', now=0.0).finish_reason == 'busy'
    assert queue.register(b'b2', client='b', now=20.0).finish_reason == 'busy'   # twice a 20 s gap: 40 s
    queue.release(b'a1')
    assert queue.register(b'a2', client='a', now=49.0).finish_reason == 'busy'
    assert accept(queue, b'a3', 'a', now=50.5)                                   # 30.5 s after b's refusal


def test_a_goal_long_after_a_refusal_is_a_new_visit_not_a_slow_retry():
    queue = ready_queue(max_waiting=0, fair_claim=1.0)
    accept(queue, b'a1', 'a', now=0.0)
    assert queue.register(b'b1', client='b', now=0.5).finish_reason == 'busy'
    assert queue.register(b'b2', client='b', now=40.0).finish_reason == 'busy'   # 39.5 s later: no pace learned
    queue.release(b'a1')
    assert accept(queue, b'a2', 'a', now=41.1)                                   # b's claim lived fair_claim


def test_first_come_without_fair_claim():
    queue = GoalQueue(max_waiting=0, fair_claim=0.0)
    queue.set_loading()
    queue.set_ready()
    accept(queue, b'1', 'a', now=0.0)
    assert queue.register(b'2', client='b', now=0.1).finish_reason == 'busy'
    queue.release(b'1')
    assert accept(queue, b'3', 'a', now=0.2)


def test_waiting_goals_run_round_robin_by_client():
    queue = GoalQueue(max_waiting=4)
    queue.set_loading()
    queue.set_ready()
    jobs = [accept(queue, key, client) for key, client in
            ((b'a1', 'a'), (b'a2', 'a'), (b'a3', 'a'), (b'b1', 'b'), (b'c1', 'c'))]
    for job in jobs:
        queue.enqueue(job)
    order = []
    while queue.depth()[0]:
        job = queue.take()
        order.append(job.key)
        queue.finished(job)
    assert order == [b'a1', b'b1', b'c1', b'a2', b'a3']


def test_goal_timeout_ends_waiting_and_running_goals():
    queue = GoalQueue()
    queue.set_loading()
    queue.set_ready()
    running, waiting = accept(queue, b'1', now=0.0), accept(queue, b'2', now=5.0)
    queue.enqueue(running)
    queue.enqueue(waiting)
    assert queue.take() is running
    assert queue.expire(10.0, now=12.0) == [running]
    assert running.cancel.cancelled and running.finish_reason == 'timeout' and not running.done.is_set()
    assert 'queue.goal_timeout = 10 s' in running.error and 'partial text kept' in running.error
    assert queue.expire(10.0, now=16.0) == [waiting]
    assert waiting.done.is_set() and waiting.finish_reason == 'timeout' and 'never started' in waiting.error
    assert queue.expire(10.0, now=30.0) == []   # each goal ends once


def test_goal_without_receivers_is_dropped():
    queue = GoalQueue()
    queue.set_loading()
    queue.set_ready()
    mine = accept(queue, b'1', listeners={b'me'}, now=0.0)
    late = accept(queue, b'2', listeners=set(), now=0.0)   # its client's subscription was not yet discovered
    shared = accept(queue, b'3', listeners={b'me', b'other'}, now=0.0)
    assert queue.drop_orphans({b'me', b'late'}, now=1.0) == []      # within the grace: receivers are collected
    queue.enqueue(mine)
    assert queue.take() is mine
    after = LISTENER_GRACE + 1.0
    assert queue.drop_orphans({b'other', b'newcomer'}, now=after) == [mine, late]
    assert mine.cancel.cancelled and mine.error == ORPHANED_REASON and mine.finish_reason == 'cancelled'
    assert not shared.cancel.cancelled    # another client present at acceptance is still there
    assert queue.drop_orphans(set(), now=after) == [shared]
    unknown = accept(queue, b'4', now=after)
    assert queue.drop_orphans(set(), now=after + 1.0) == []
    assert queue.drop_orphans(set(), now=after + LISTENER_GRACE + 1.0) == []   # never had a receiver: left alone
    assert not unknown.cancel.cancelled


def test_goals_wait_while_the_engine_loads():
    queue = GoalQueue()
    queue.set_loading()
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
    queue.set_loading()
    waiting = accept(queue, b'a')
    queue.enqueue(waiting)
    queue.set_failed('engine failed to load: no model')
    assert waiting.done.is_set() and waiting.error == 'engine failed to load: no model'
    late = queue.register(b'b')
    assert late.done.is_set() and late.error == 'engine failed to load: no model'
    assert not queue.set_ready()


def test_cancel_before_the_goal_is_registered():
    queue = GoalQueue()
    queue.set_loading()
    queue.set_ready()
    queue.cancel(b'x')                      # the cancel overtook handle_accepted
    job = queue.register(b'x')
    assert job.client_cancelled and job.cancel.cancelled
    queue.enqueue(job)
    assert job.done.is_set() and job.error == '' and queue.depth() == (0, False)


def test_cancel_of_a_waiting_goal_leaves_the_queue():
    queue = GoalQueue()
    queue.set_loading()
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
    queue.set_loading()
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
    queue.set_loading()
    queue.set_ready()
    running, waiting = accept(queue, b'1'), accept(queue, b'2')
    queue.enqueue(running)
    queue.enqueue(waiting)
    assert queue.take() is running
    queue.shutdown()
    assert waiting.done.is_set() and waiting.error == SHUTDOWN_REASON
    assert running.cancel.cancelled and running.error == SHUTDOWN_REASON
    late = queue.register(b'3')
    assert late.done.is_set() and late.error == SHUTDOWN_REASON and queue.take() is None
    assert not queue.wait_until_released(0.05)   # both execute callbacks still hold their slots
    queue.release(b'1')
    queue.release(b'2')
    assert queue.wait_until_released(1.0)


def test_an_unconfigured_node_refuses_goals_with_its_state():
    queue = GoalQueue()
    job = queue.register(b'a')
    assert job.done.is_set() and not job.admitted and job.error == 'node is unconfigured'
    assert not queue.set_ready()  # only a configured (loading or inactive) node becomes active


def test_deactivate_refuses_new_goals_ends_waiting_ones_and_finishes_or_cancels_the_running_one():
    for cancel_running in (False, True):
        queue = GoalQueue()
        queue.set_loading()
        queue.set_ready()
        running, waiting = accept(queue, b'a'), accept(queue, b'b')
        queue.enqueue(running)
        queue.enqueue(waiting)
        assert queue.take() is running
        queue.set_inactive('node is inactive', cancel_running=cancel_running)
        assert waiting.done.is_set() and waiting.error == 'node is inactive'
        assert running.cancel.cancelled == cancel_running and not running.done.is_set()
        assert (running.error, running.finish_reason) == (('node is inactive', 'cancelled') if cancel_running
                                                          else ('', ''))
        late = queue.register(b'c')
        assert late.done.is_set() and late.error == 'node is inactive'
        queue.finished(running)
        assert queue.set_ready()  # activate again: goals are served
        again = accept(queue, b'd')
        queue.enqueue(again)
        assert queue.take() is again


def test_cleanup_ends_every_goal_and_configure_starts_over():
    queue = GoalQueue()
    queue.set_loading()
    queue.set_ready()
    running = accept(queue, b'a')
    queue.enqueue(running)
    assert queue.take() is running
    queue.set_unconfigured('node cleaned up')
    assert running.cancel.cancelled and running.error == 'node cleaned up'
    assert queue.register(b'b').error == 'node cleaned up'
    assert queue.set_loading() and queue.set_ready()
    accept(queue, b'c')


def serving_queue(max_running, **kwargs):
    queue = GoalQueue(**kwargs)
    queue.set_loading()
    queue.set_ready()
    assert queue.set_max_running(max_running) == max_running
    return queue


def take_in_thread(queue):
    """Start a worker's take(); return (thread, list that receives the job)."""
    taken = []
    thread = threading.Thread(target=lambda: taken.append(queue.take()), daemon=True)
    thread.start()
    return thread, taken


def test_two_goals_run_at_once_and_the_third_waits_for_a_slot():
    queue = serving_queue(2, max_waiting=1)
    jobs = [accept(queue, key) for key in (b'1', b'2', b'3')]
    busy = queue.register(b'4')
    assert busy.finish_reason == 'busy' and busy.error.startswith('busy: 3 of 3 slots taken (2 running + up to '
                                                                  'queue.max_length 1 waiting)')
    for job in jobs:
        queue.enqueue(job)
    assert queue.take() is jobs[0] and queue.take() is jobs[1] and queue.depth() == (1, 2)
    worker, taken = take_in_thread(queue)
    worker.join(0.2)
    assert worker.is_alive() and not taken            # both slots are held
    queue.finished(jobs[1])
    worker.join(5)
    assert taken == [jobs[2]] and queue.depth() == (0, 2)
    assert jobs[1].done.is_set() and not jobs[0].done.is_set()


def test_fair_admission_picks_who_runs_in_each_slot():
    queue = serving_queue(2, max_waiting=4)
    jobs = [accept(queue, key, client) for key, client in
            ((b'a1', 'a'), (b'a2', 'a'), (b'a3', 'a'), (b'b1', 'b'), (b'c1', 'c'))]
    for job in jobs:
        queue.enqueue(job)
    first, second = queue.take(), queue.take()
    assert [first.key, second.key] == [b'a1', b'b1']   # one slot each, not both to the client that came first
    queue.finished(first)
    assert queue.take().key == b'c1'
    queue.finished(second)
    assert queue.take().key == b'a2'


def test_cancel_of_one_running_goal_leaves_the_others():
    queue = serving_queue(2)
    first, second, waiting = accept(queue, b'1'), accept(queue, b'2'), accept(queue, b'3')
    for job in (first, second, waiting):
        queue.enqueue(job)
    assert queue.take() is first and queue.take() is second
    queue.cancel(b'1')
    assert first.cancel.cancelled and not first.done.is_set()
    assert not second.cancel.cancelled and second.error == '' and not waiting.done.is_set()
    queue.finished(first)                             # the worker ended it within a round
    assert queue.take() is waiting and not second.cancel.cancelled


def test_time_limit_and_orphans_stop_only_their_running_goal():
    queue = serving_queue(2)
    old, young = accept(queue, b'1', listeners={b'gone'}, now=0.0), accept(queue, b'2', listeners={b'me'}, now=5.0)
    queue.enqueue(old)
    queue.enqueue(young)
    assert queue.take() is old and queue.take() is young
    assert queue.drop_orphans({b'me'}, now=LISTENER_GRACE + 6.0) == [old]
    assert old.cancel.cancelled and not young.cancel.cancelled
    assert queue.expire(10.0, now=16.0) == [young] and young.finish_reason == 'timeout'


def test_preempt_with_several_slots_takes_the_oldest_running_goal_only_when_all_are_held():
    queue = serving_queue(2, policy='preempt')
    first, second, third, fourth = (accept(queue, key) for key in (b'1', b'2', b'3', b'4'))
    queue.enqueue(first)
    assert queue.take() is first
    queue.enqueue(second)                             # a slot is free: nothing is preempted
    assert not first.preempted and queue.take() is second
    queue.enqueue(third)                              # both slots held: the oldest running goal makes room
    assert first.preempted and first.cancel.cancelled and first.error == PREEMPTED_REASON
    assert not second.cancel.cancelled and queue.take() is third   # first only ends its round
    queue.enqueue(fourth)
    assert second.preempted and not third.cancel.cancelled and queue.take() is fourth
    assert queue.depth() == (0, 4)
    for job in (first, second):
        queue.finished(job)
    assert queue.depth() == (0, 2)


def test_preempt_spares_running_goals_that_are_already_stopping():
    queue = serving_queue(2, policy='preempt')
    first, second, newest = accept(queue, b'1'), accept(queue, b'2'), accept(queue, b'3')
    for job in (first, second):   # one at a time: under preempt a new goal aborts the waiting ones
        queue.enqueue(job)
        assert queue.take() is job
    queue.cancel(b'2')                                # its slot frees within a round
    queue.enqueue(newest)
    assert not first.preempted and not first.cancel.cancelled and not second.preempted
    queue.finished(second)
    assert queue.take() is newest


def test_shutdown_and_deactivate_end_every_running_goal():
    for stop in ('shutdown', 'finish', 'cancel'):
        queue = serving_queue(2)
        jobs = [accept(queue, key) for key in (b'1', b'2', b'3')]
        for job in jobs:
            queue.enqueue(job)
        running = [queue.take(), queue.take()]
        if stop == 'shutdown':
            queue.shutdown()
        else:
            queue.set_inactive('node is inactive', cancel_running=stop == 'cancel')
        reason = SHUTDOWN_REASON if stop == 'shutdown' else 'node is inactive'
        assert jobs[2].done.is_set() and jobs[2].error == reason
        assert all(job.cancel.cancelled == (stop != 'finish') for job in running)
        assert all(job.error == ('' if stop == 'finish' else reason) for job in running)
        assert not queue.wait_until_idle(0.05)        # waits for both running goals
        queue.finished(running[0])
        assert not queue.wait_until_idle(0.05)
        queue.finished(running[1])
        assert queue.wait_until_idle(1.0)


def test_shutdown_wakes_every_waiting_worker():
    queue = serving_queue(3)
    workers = [take_in_thread(queue) for _ in range(3)]
    queue.shutdown()
    for thread, taken in workers:
        thread.join(5)
        assert taken == [None]


def test_fewer_slots_let_the_running_goals_finish_before_the_next_starts():
    queue = serving_queue(2)
    jobs = [accept(queue, key) for key in (b'1', b'2', b'3')]
    for job in jobs:
        queue.enqueue(job)
    running = [queue.take(), queue.take()]
    assert queue.set_max_running(1) == 1 and queue.set_max_running(0) == 1   # at least one slot
    worker, taken = take_in_thread(queue)
    queue.finished(running[0])
    worker.join(0.2)
    assert worker.is_alive() and not taken and not running[1].cancel.cancelled
    queue.finished(running[1])
    worker.join(5)
    assert taken == [jobs[2]]

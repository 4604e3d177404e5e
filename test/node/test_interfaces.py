"""gemma_spec_msgs: the interfaces import, serialize, and round-trip through a real ActionServer/ActionClient."""

import os
import threading

import rclpy
from gemma_spec_msgs.action import Generate
from gemma_spec_msgs.msg import ChatMessage, GenerateRequest, GenerateResponse, GenerationStats
from rclpy.action import ActionClient, ActionServer
from rclpy.executors import MultiThreadedExecutor
from rclpy.serialization import deserialize_message, serialize_message

DOMAIN_ID = 11 + (os.getpid() + 29) % 80


def test_messages_round_trip_through_cdr():
    request = GenerateRequest(request_id='r1', prompt='plan', messages=[ChatMessage(role='user', content='hi')],
                              max_new_tokens=7, temperature=0.5, stop=['\n'], seed=3, drafter='mtp')
    assert deserialize_message(serialize_message(request), GenerateRequest) == request
    response = GenerateResponse(request_id='r1', accepted=True, status='succeeded', text='ok', token_ids=[1, 2],
                                stats=GenerationStats(tau=2.5, per_position_acceptance=[0.9, 0.5], drafter='mtp'))
    assert deserialize_message(serialize_message(response), GenerateResponse) == response
    assert Generate.Goal().seed == -1 and GenerateRequest().seed == -1


def test_action_round_trip(context):
    server_node = rclpy.create_node('interfaces_server', context=context)
    client_node = rclpy.create_node('interfaces_client', context=context)

    def execute(goal_handle):
        for piece in ('Hello', ' robot'):
            goal_handle.publish_feedback(Generate.Feedback(text_delta=piece, token_ids_delta=[len(piece)],
                                                           tokens_generated=len(piece), tau=1.0))
        goal_handle.succeed()
        return Generate.Result(text='Hello robot', token_ids=[5, 6], finish_reason='length',
                               stats=GenerationStats(new_tokens=2, tau=1.0))

    server = ActionServer(server_node, Generate, 'generate', execute_callback=execute)
    client = ActionClient(client_node, Generate, 'generate')
    executor = MultiThreadedExecutor(num_threads=4, context=context)
    executor.add_node(server_node)
    executor.add_node(client_node)
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            executor.spin_once(timeout_sec=0.05)

    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        assert client.wait_for_server(timeout_sec=10)
        feedback, done = [], threading.Event()
        goal = Generate.Goal(prompt='hi', messages=[ChatMessage(role='user', content='hi')], max_new_tokens=2)
        result_box = {}

        def on_goal(future):
            handle = future.result()
            assert handle.accepted
            handle.get_result_async().add_done_callback(lambda f: (result_box.update(r=f.result()), done.set()))

        # send from the spinning thread's executor so that the response cannot race the bookkeeping
        executor.create_task(lambda: client.send_goal_async(
            goal, feedback_callback=lambda m: feedback.append(m.feedback)).add_done_callback(on_goal))
        assert done.wait(10), 'no result'
        response = result_box['r']
        assert response.status == 4  # STATUS_SUCCEEDED
        assert response.result.text == 'Hello robot' and list(response.result.token_ids) == [5, 6]
        assert [f.text_delta for f in feedback] == ['Hello', ' robot']
    finally:
        stop.set()
        spinner.join()
        executor.shutdown(timeout_sec=1)
        client.destroy()
        server.destroy()
        client_node.destroy_node()
        server_node.destroy_node()

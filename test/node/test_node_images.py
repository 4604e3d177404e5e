"""Image goals through the node with a real rclpy client: answered on the bundled vision model, bad ones refused."""

import io
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
from conftest import NO_DIAGNOSTIC_UPDATER, REPO_ROOT, TEST_COMPILE, engine_status, spinning_node

pytest.importorskip('diagnostic_updater', reason=NO_DIAGNOSTIC_UPDATER)

from diagnostic_updater import DiagnosticStatusWrapper
from PIL import Image as PilImage
from rosbags.rosbag2 import Reader
from sensor_msgs.msg import CompressedImage, Image

from gemma_spec_ros.engine.types import GenerationStats
from gemma_spec_ros.ros import diagnostics
from gemma_spec_ros.tools.bag import REQUESTS_TOPIC, read_bag, typestore
from gemma_spec_ros.tools.client import compressed_image_from_file, image_from_file, make_goal

DOMAIN_ID = 11 + (os.getpid() + 59) % 80
MAX_PIXELS = 64 * 64
QUESTION = 'Which objects are on the table?'
VISION_MODEL = REPO_ROOT / 'models' / 'gemma4-spec-vision'   # the bundled target with a vision tower


def rgb8(width=4, height=4, encoding='rgb8', data=None) -> Image:
    return Image(width=width, height=height, encoding=encoding, step=3 * width,
                 data=bytes(3 * width * height) if data is None else data)


def png(width=4, height=4, image_format='PNG') -> bytes:
    buffer = io.BytesIO()
    PilImage.new('RGB', (width, height), (200, 40, 40)).save(buffer, format=image_format)
    return buffer.getvalue()


def image_goal(images=(), compressed_images=(), indices=None):
    count = len(images) + len(compressed_images)
    return make_goal(messages=[('user', QUESTION, range(count) if indices is None else indices)], max_new_tokens=4,
                     images=images, compressed_images=compressed_images)


@pytest.fixture(scope='module')
def served(context, tiny_models):
    params = {'engine.target_path': tiny_models.target, 'engine.drafter': 'none', 'engine.device': 'cpu',
              'engine.dtype': 'float32', 'engine.compile': TEST_COMPILE, 'generation.max_images_per_goal': 2,
              'generation.max_image_pixels': MAX_PIXELS}
    with spinning_node(context, 'gemma_spec_images', params) as pair:
        yield pair


BAD_IMAGE_GOALS = [
    (image_goal([rgb8(), rgb8(encoding='yuv422')]), "images[1].encoding: 'yuv422' is not one of rgb8, bgr8, mono8"),
    (image_goal([rgb8(width=0, data=b'')]), 'images[0]: empty image (0x4 pixels)'),
    (image_goal([rgb8(data=bytes(47))]), 'images[0].data: 47 bytes, expected step 12 x height 4 = 48'),
    (image_goal([rgb8(width=65, height=64)]),
     'images[0]: 65x64 = 4160 pixels, more than generation.max_image_pixels = 4096'),
    (image_goal([rgb8()], [CompressedImage(format='png', data=png(80, 80))]),
     'compressed_images[0]: 80x80 = 6400 pixels, more than generation.max_image_pixels = 4096'),
    (image_goal([rgb8()] * 2, [CompressedImage(format='png', data=png())]),
     'images + compressed_images: 3 images, more than generation.max_images_per_goal = 2'),
    (image_goal(compressed_images=[CompressedImage(format='tiff', data=png())]),
     "compressed_images[0].format: 'tiff' is not one of jpeg, png"),
    (image_goal(compressed_images=[CompressedImage(format='jpeg', data=png())]),
     'compressed_images[0].data: a png image, but format says jpeg'),
    (image_goal([rgb8()], indices=[1]), 'messages[0].image_indices[0]: 1 is not an index into the 1 image(s)'),
    (make_goal(prompt=QUESTION, images=[rgb8()]), 'images: the target reads text only (it has no vision tower)'),
]


@pytest.mark.parametrize('goal, expected', BAD_IMAGE_GOALS, ids=[e[:32] for _, e in BAD_IMAGE_GOALS])
def test_bad_image_goal_is_aborted_naming_the_field(served, goal, expected):
    _, client = served
    outcome = client.send(goal)
    assert outcome.accepted and outcome.status == 'aborted'
    assert outcome.result.error.startswith(expected), outcome.result.error
    assert outcome.result.finish_reason == 'error' and not outcome.feedback


def test_image_files_become_sensor_messages(tmp_path):
    (tmp_path / 'scene.png').write_bytes(png(6, 5))
    (tmp_path / 'scene.jpg').write_bytes(png(6, 5, 'JPEG'))
    (tmp_path / 'scene.gif').write_bytes(png(6, 5, 'GIF'))
    raw = image_from_file(tmp_path / 'scene.png')
    assert (raw.encoding, raw.width, raw.height, raw.step, bytes(raw.data[:3])) == ('rgb8', 6, 5, 18, b'\xc8\x28\x28')
    assert compressed_image_from_file(tmp_path / 'scene.jpg').format == 'jpeg'
    assert bytes(compressed_image_from_file(tmp_path / 'scene.png').data) == png(6, 5)
    with pytest.raises(ValueError, match='scene.gif: a GIF image; goals take png or jpeg files'):
        compressed_image_from_file(tmp_path / 'scene.gif')


def test_client_command_refuses_an_image_it_cannot_send(tmp_path):
    (tmp_path / 'scene.gif').write_bytes(png(6, 5, 'GIF'))
    completed = subprocess.run([sys.executable, '-m', 'gemma_spec_ros', 'client', QUESTION, '--image',
                                str(tmp_path / 'scene.gif')], capture_output=True, text=True, timeout=120,
                               cwd=REPO_ROOT)
    assert completed.returncode == 2
    assert 'scene.gif: a GIF image; goals take png or jpeg files' in completed.stderr


def run_cli(*args):
    env = dict(os.environ, ROS_DOMAIN_ID=str(DOMAIN_ID), ROS_AUTOMATIC_DISCOVERY_RANGE='LOCALHOST')
    return subprocess.run([sys.executable, '-m', 'gemma_spec_ros', *args], env=env, capture_output=True, text=True,
                          timeout=300, cwd=REPO_ROOT)


def test_record_and_replay_an_image_goal(vision_served, tmp_path):
    (tmp_path / 'scene.png').write_bytes(png(6, 5))
    (tmp_path / 'scene.jpg').write_bytes(png(8, 8, 'JPEG'))
    requests = tmp_path / 'requests.jsonl'
    requests.write_text(json.dumps({
        'request_id': 'image', 'images': ['scene.png'], 'compressed_images': ['scene.jpg'], 'max_new_tokens': 4,
        'messages': [{'role': 'user', 'content': QUESTION, 'image_indices': [1, 0]}]}) + '\n')
    bag = tmp_path / 'bag'
    recorded = run_cli('record', str(requests), '--output', str(bag), '--node', 'gemma_spec_vision',
                       '--action', '/gemma_spec_vision/generate')
    assert recorded.returncode == 0, recorded.stdout + recorded.stderr

    with Reader(bag) as reader:   # rosbags' own CDR decoder reads the sensor_msgs/Image it wrote
        connection = next(c for c in reader.connections if c.topic == REQUESTS_TOPIC)
        _, _, data = next(reader.messages(connections=[connection]))
        decoded = typestore().deserialize_cdr(bytes(data), connection.msgtype)
    assert decoded.images[0].encoding == 'rgb8' and bytes(decoded.images[0].data) == image_from_file(
        tmp_path / 'scene.png').data.tobytes()
    (_, request), = read_bag(bag)[0]
    assert list(request.messages[0].image_indices) == [1, 0] and request.compressed_images[0].format == 'jpeg'
    assert read_bag(bag)[1]['image'].status == 'succeeded'

    replayed = run_cli('replay', str(bag), '--node', 'gemma_spec_vision', '--action', '/gemma_spec_vision/generate')
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    assert 'greedy parity: 1/1 identical; 0 of 1 requests failed' in replayed.stdout


def test_diagnostics_show_image_prefill_apart(served):
    metrics = diagnostics.GenerationMetrics(window=8)
    for image_prefill_ms in (0.0, 30.0, 50.0):   # a text goal, then two image goals
        stats = GenerationStats(new_tokens=4, target_passes=4, tau=1.0, time_to_first_token=0.2,
                                tokens_per_second=20.0, drafter='none', image_prefill_ms=image_prefill_ms)
        metrics.record('succeeded', SimpleNamespace(stats=stats, warnings=[]))
    stat = diagnostics.fill_generation_status(DiagnosticStatusWrapper(), metrics, 0, 0)
    shown = {kv.key: kv.value for kv in stat.values}
    assert (shown['image prefill p50 (ms)'], shown['image prefill p95 (ms)']) == ('40.0', '49.0')
    assert (shown['goals with images in window'], shown['goals in window']) == ('2', '3')
    node, client = served   # the node says whether its backend reads images, and why not
    _, _, values, _ = engine_status(client, 'gemma_spec_images', lambda entry: 'images' in entry[2])
    capabilities = node.backend.capabilities
    assert values['images'] == ('accepted' if capabilities.images else 'refused: ' + capabilities.image_refusal)


@pytest.fixture(scope='module')
def vision_served(context):
    params = {'engine.target_path': str(VISION_MODEL), 'engine.drafter': 'none', 'engine.device': 'cpu',
              'engine.dtype': 'float32', 'engine.compile': TEST_COMPILE, 'diagnostic_updater.period': 0.2}
    with spinning_node(context, 'gemma_spec_vision', params) as pair:
        yield pair


def test_an_image_goal_gets_the_same_answer_from_every_encoding(vision_served):
    node, client = vision_served
    assert node.backend.capabilities.images, node.backend.capabilities.image_refusal
    scene = json.loads((VISION_MODEL / 'demo_scene.json').read_text())
    compressed = compressed_image_from_file(VISION_MODEL / 'demo_scene.png')
    rgb = image_from_file(VISION_MODEL / 'demo_scene.png')
    pixels = bytes(rgb.data)
    bgr = Image(width=rgb.width, height=rgb.height, encoding='bgr8', step=rgb.step,
                data=b''.join(pixels[i:i + 3][::-1] for i in range(0, len(pixels), 3)))
    outcomes = [client.send(make_goal(messages=[('user', scene['question'], [0])], max_new_tokens=16, **images))
                for images in (dict(compressed_images=[compressed]), dict(images=[rgb]), dict(images=[bgr]))]
    for outcome in outcomes:
        assert outcome.status == 'succeeded', outcome.result.error
    first = outcomes[0].result
    assert first.text.strip() and first.stats.image_prefill_ms > 0
    assert first.stats.time_to_first_token * 1000 > first.stats.image_prefill_ms
    assert [list(o.result.token_ids) for o in outcomes[1:]] == [list(first.token_ids)] * 2

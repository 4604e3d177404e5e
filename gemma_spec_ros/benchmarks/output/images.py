"""
Image goals against text goals on one engine: what an image costs at prefill, and what it costs each decode step.

``python -m gemma_spec_ros bench images [--target models/gemma4-spec-vision] [--image PNG] [--repeats 5]``

Two measurements, interleaved over --repeats so that drift hits both alike:

- goals: the same question with the image shown before it and without, per drafter. Reported: the image prefill
  (the processor, the vision tower and the embedder: GenerationStats.image_prefill_ms), time to first token (which
  includes it), prompt tokens, new tokens, decode tokens/s and tau; medians over the repeats.
- steps: the target's plain decode steps after each prompt, --steps of them with the argmax fed back and EOS
  ignored, so that the rate covers the same number of steps whatever the model answers: the decode rate at the
  image goal's context against the text goal's.
- frame sizes: the image prefill alone (VisionTower.encode) of the image resized to common camera frames.
"""

import argparse
import statistics
import time
from pathlib import Path

import torch

from gemma_spec_ros.engine import Engine, EngineConfig, GenerationRequest
from gemma_spec_ros.engine.types import ImageInput

MODELS = Path(__file__).resolve().parents[3] / 'models'
QUESTION = 'Which objects are on the table?'
FRAMES = ((320, 240), (640, 480), (1280, 720))


def read_image(path: str) -> ImageInput:
    from PIL import Image

    with Image.open(path) as image:
        rgb = image.convert('RGB')
    return ImageInput(rgb.width, rgb.height, rgb.tobytes())


def goal(image: ImageInput | None, drafter: str, new_tokens: int) -> GenerationRequest:
    message = {'role': 'user', 'content': QUESTION, **({'images': [0]} if image else {})}
    return GenerationRequest(messages=[message], images=(image,) if image else (), max_new_tokens=new_tokens,
                             drafter=drafter)


def decode_steps_per_second(engine: Engine, request: GenerationRequest, steps: int) -> float:
    """Prefill the request's prompt (images included), then time steps plain decode steps of the target."""
    plan = engine.validate(request)
    with engine.exclusive() as target:
        target.reset()
        soft = engine.vision.encode(plan.images) if plan.images else None
        out = target.prefill(torch.tensor([plan.prompt_ids]), 1, False, soft)
        token = out.logits[0, -1:].argmax(dim=-1)
        started = time.perf_counter()
        for _ in range(steps):
            token = target.append(token[None], logits_to_keep=0).logits[0, -1:].argmax(dim=-1)
        token.item()
        return steps / (time.perf_counter() - started)


def resized(image: ImageInput, width: int, height: int) -> ImageInput:
    from PIL import Image

    picture = Image.frombytes('RGB', (image.width, image.height), image.rgb).resize((width, height))
    return ImageInput(width, height, picture.tobytes())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog='python -m gemma_spec_ros bench images', description=__doc__.split('\n\n')[1])
    parser.add_argument('--target', default=str(MODELS / 'gemma4-spec-vision'))
    parser.add_argument('--assistant', default=str(MODELS / 'gemma4-spec-assistant'))
    parser.add_argument('--draft', default=str(MODELS / 'gemma4-spec-draft'))
    parser.add_argument('--image', default=str(MODELS / 'gemma4-spec-vision' / 'demo_scene.png'))
    parser.add_argument('--drafters', default='none,mtp,draft,ngram')
    parser.add_argument('--compile', default='auto')
    parser.add_argument('--repeats', type=int, default=5)
    parser.add_argument('--new-tokens', type=int, default=32)
    parser.add_argument('--steps', type=int, default=64)
    args = parser.parse_args(argv)

    engine = Engine.from_config(EngineConfig(target_path=args.target, assistant_path=args.assistant,
                                             draft_model_path=args.draft, compile=args.compile, warmup='blocking',
                                             num_threads=1, drafter='none'), progress=print)
    image = read_image(args.image)
    drafters = args.drafters.split(',')
    cases = [(drafter, shown) for drafter in drafters for shown in (image, None)]
    rows: dict[tuple[str, bool], list] = {(drafter, shown is not None): [] for drafter, shown in cases}
    rates: dict[bool, list[float]] = {True: [], False: []}
    frames = {size: resized(image, *size) for size in FRAMES}
    encode_ms: dict[tuple[int, int], list[float]] = {size: [] for size in frames}
    for drafter, shown in cases:  # warm-up: first calls build what a goal needs
        engine.generate(goal(shown, drafter, args.new_tokens))
    for _ in range(args.repeats):
        for drafter, shown in cases:
            rows[drafter, shown is not None].append(engine.generate(goal(shown, drafter, args.new_tokens)).stats)
        for shown in (image, None):
            rates[shown is not None].append(decode_steps_per_second(engine, goal(shown, 'none', 1), args.steps))
        for size, frame in frames.items():
            encode_ms[size].append(engine.vision.encode((frame,)).seconds * 1000.0)

    print('\nimage {} ({}x{}); target {}, decode steps {}; medians of {} repeats\n'.format(
        Path(args.image).name, image.width, image.height, Path(args.target).name, engine.target_lm.mode,
        args.repeats))
    print('| drafter | goal | prompt tokens | image prefill ms | TTFT ms | new tokens | decode tok/s | tau |')
    print('|---|---|---|---|---|---|---|---|')
    for (drafter, with_image), stats in rows.items():
        def median(field, scale=1.0, stats=stats):
            return statistics.median(getattr(s, field) for s in stats) * scale
        print('| {} | {} | {:.0f} | {:.1f} | {:.1f} | {:.0f} | {:.1f} | {:.2f} |'.format(
            drafter, 'image + text' if with_image else 'text', median('prompt_tokens'), median('image_prefill_ms'),
            median('time_to_first_token', 1000.0), median('new_tokens'), median('tokens_per_second'),
            median('tau')))
    print('\ntarget plain decode steps ({} steps, EOS ignored): {:.1f} tok/s after the image goal\'s prompt, {:.1f} '
          'after the text goal\'s'.format(args.steps, statistics.median(rates[True]), statistics.median(rates[False])))
    print('image prefill of a camera frame: ' + ', '.join('{}x{} {:.1f} ms ({} soft tokens)'.format(
        width, height, statistics.median(encode_ms[width, height]), engine.vision.soft_token_count(width, height))
        for width, height in frames))


if __name__ == '__main__':
    main()

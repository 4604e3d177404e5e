"""
Synthetic table scenes for the bundled vision model: coloured objects on a table and a door, with questions.

A scene has up to three objects in the table's left, middle and right slots and a door in the back wall that is
open or closed. `render` draws it with PIL (128 x 128 RGB, jittered sizes, positions and colours);
`questions` gives every question the scene answers, each with its one right answer, in the fixed wording the
model was trained on. Held-out scenes (`is_held_out`) are a fixed 10 % of all scene layouts, never trained on.

Torch-free (PIL and the standard library only), so a demo can draw a scene and know its answer:

    scene = held_out_scene(seed=3)
    image, question = render(scene), questions(scene)[0]   # question.text, question.answer
"""

import hashlib
import random
from dataclasses import dataclass

from PIL import Image, ImageDraw

IMAGE_SIZE = 128
SLOTS = ('left', 'middle', 'right')
COLOURS = {'red': (200, 40, 40), 'green': (40, 160, 60), 'blue': (50, 80, 210), 'yellow': (225, 200, 40)}
SHAPES = ('cube', 'ball', 'cup', 'cone')
NUMBERS = ('no', 'one', 'two', 'three')
HELD_OUT_PERCENT = 10
QUESTION_KINDS = ('objects', 'door', 'where', 'count', 'colour')


@dataclass(frozen=True)
class SceneObject:
    colour: str
    shape: str
    slot: str

    @property
    def name(self) -> str:
        return f'{self.colour} {self.shape}'


@dataclass(frozen=True)
class Scene:
    objects: tuple[SceneObject, ...]   # left to right, at most one per slot, no two with the same colour and shape
    door_open: bool
    jitter_seed: int                   # sizes, offsets and shades: not part of the layout

    def __post_init__(self):
        slots = [o.slot for o in self.objects]
        if not 1 <= len(self.objects) <= len(SLOTS) or slots != sorted(set(slots), key=SLOTS.index):
            raise ValueError(f'a scene has 1 to 3 objects in distinct slots, left to right: {slots}')
        if len({o.name for o in self.objects}) != len(self.objects):
            raise ValueError(f'two objects of a scene share colour and shape: {[o.name for o in self.objects]}')
        for o in self.objects:
            if o.colour not in COLOURS or o.shape not in SHAPES:
                raise ValueError(f'unknown colour or shape: {o.name}')

    @property
    def layout(self) -> str:
        """What the questions depend on: objects with slots and the door (equal layouts render alike)."""
        things = ', '.join(f'{o.name} {o.slot}' for o in self.objects)
        return f"{things}; door {'open' if self.door_open else 'closed'}"


@dataclass(frozen=True)
class Question:
    kind: str      # one of QUESTION_KINDS
    text: str
    answer: str


def is_held_out(scene: Scene) -> bool:
    """Tell whether the layout is in the fixed held-out 10 % (by hash): never trained on, the only ones evaluated."""
    digest = hashlib.sha256(scene.layout.encode()).digest()
    return digest[0] * 100 // 256 < HELD_OUT_PERCENT


def random_scene(rng: random.Random) -> Scene:
    count = rng.randint(1, len(SLOTS))
    slots = sorted(rng.sample(SLOTS, count), key=SLOTS.index)
    names = rng.sample([(c, s) for c in COLOURS for s in SHAPES], count)
    objects = tuple(SceneObject(colour, shape, slot) for (colour, shape), slot in zip(names, slots, strict=True))
    return Scene(objects, rng.random() < 0.5, rng.getrandbits(32))


def training_scene(rng: random.Random) -> Scene:
    while is_held_out(scene := random_scene(rng)):
        pass
    return scene


def held_out_scene(seed: int) -> Scene:
    """Draw the held-out scene of seed (the same on every run and machine)."""
    rng = random.Random(f'held-out {seed}')
    while not is_held_out(scene := random_scene(rng)):
        pass
    return scene


def listing(objects: tuple[SceneObject, ...]) -> str:
    names = [f'a {o.name}' for o in objects]
    return names[0] if len(names) == 1 else ', '.join(names[:-1]) + ' and ' + names[-1]


def questions(scene: Scene) -> list[Question]:
    """One question of each kind the scene can answer (colour only for a shape that appears once)."""
    rng = random.Random(scene.jitter_seed)
    target = rng.choice(scene.objects)
    asked = [Question('objects', 'Which objects are on the table?', listing(scene.objects)),
             Question('door', 'Is the door open?', 'yes' if scene.door_open else 'no'),
             Question('where', f'Where is the {target.name}?', target.slot),
             Question('count', 'How many objects are on the table?', NUMBERS[len(scene.objects)])]
    unique = [o for o in scene.objects if [p.shape for p in scene.objects].count(o.shape) == 1]
    if unique:
        pick = rng.choice(unique)
        asked.append(Question('colour', f'What colour is the {pick.shape}?', pick.colour))
    return asked


# ---------------------------------------------------------------------------------------------------- drawing
def _shade(rgb: tuple[int, int, int], rng: random.Random, spread: int = 18) -> tuple[int, int, int]:
    return tuple(max(0, min(255, c + rng.randint(-spread, spread))) for c in rgb)


def _draw_door(draw: ImageDraw.ImageDraw, open_: bool, rng: random.Random, table_top: int) -> None:
    width, height = rng.randint(24, 30), rng.randint(44, 52)
    left = rng.choice((rng.randint(8, 20), IMAGE_SIZE - width - rng.randint(8, 20)))
    top = table_top - height + rng.randint(2, 6)
    frame = _shade((90, 60, 35), rng)
    draw.rectangle((left - 2, top - 2, left + width + 2, table_top), fill=frame)
    if open_:   # a dark doorway with the leaf swung into the room
        draw.rectangle((left, top, left + width, table_top), fill=_shade((25, 25, 30), rng, 8))
        leaf = width * 2 // 3
        draw.polygon([(left, top), (left - leaf // 2, top + 6), (left - leaf // 2, table_top - 4), (left, table_top)],
                     fill=_shade((165, 120, 70), rng))
    else:
        draw.rectangle((left, top, left + width, table_top), fill=_shade((165, 120, 70), rng))
        knob_x = left + width - 6 if rng.random() < 0.5 else left + 4
        draw.ellipse((knob_x, top + height // 2, knob_x + 3, top + height // 2 + 3), fill=(230, 210, 90))


def _draw_object(draw: ImageDraw.ImageDraw, thing: SceneObject, centre_x: int, base_y: int,
                 rng: random.Random) -> None:
    colour = _shade(COLOURS[thing.colour], rng)
    size = rng.randint(16, 22)
    left, right, top = centre_x - size // 2, centre_x + size // 2, base_y - size
    if thing.shape == 'cube':
        depth = size // 4   # a square front and a lighter top face
        draw.polygon([(left, top), (left + depth, top - depth), (right + depth, top - depth), (right, top)],
                     fill=tuple(min(255, c + 45) for c in colour))
        draw.rectangle((left, top, right, base_y), fill=colour)
    elif thing.shape == 'ball':
        draw.ellipse((left, top, right, base_y), fill=colour)
    elif thing.shape == 'cup':
        draw.polygon([(left, top), (right, top), (right - 3, base_y), (left + 3, base_y)], fill=colour)
        draw.arc((right - 4, top + 3, right + 5, base_y - 4), -90, 90, fill=colour, width=3)
    else:   # cone
        draw.polygon([(centre_x, top - 3), (right, base_y), (left, base_y)], fill=colour)


def render(scene: Scene) -> Image.Image:
    """Draw the scene as a 128 x 128 RGB image: wall, door, table, objects in their slots."""
    rng = random.Random(scene.jitter_seed)
    image = Image.new('RGB', (IMAGE_SIZE, IMAGE_SIZE), _shade((200, 195, 185), rng, 25))
    draw = ImageDraw.Draw(image)
    table_top = rng.randint(70, 80)
    _draw_door(draw, scene.door_open, rng, table_top)
    draw.rectangle((0, table_top, IMAGE_SIZE, IMAGE_SIZE), fill=_shade((120, 85, 55), rng, 20))
    slot_width = IMAGE_SIZE // len(SLOTS)
    for thing in scene.objects:
        centre_x = slot_width * SLOTS.index(thing.slot) + slot_width // 2 + rng.randint(-6, 6)
        _draw_object(draw, thing, centre_x, table_top + rng.randint(14, 30), rng)
    return image

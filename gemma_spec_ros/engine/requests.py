"""
Every rule about a request, in one place; request planning turns a request into a RequestPlan.

The node, the CLI and the benchmark go through these functions (via Engine.validate, or VllmBackend.validate); no
other copy of a rule exists. The config's rules are in config_checks.py, the prompt's rendering in
conversation/prompt.py. Imports no torch: the tokenizer, the grammar compiler and the vision tower are passed in.
"""

import math
import os
from dataclasses import dataclass

from .config_checks import check_drafter, check_max_new_tokens, check_num_draft_tokens, number_digits
from .conversation import tools as tool_rules
from .conversation.format import ConversationTokens
from .conversation.prompt import prompt_ids, shown_images
from .conversation.reply import ReplyRules, reply_rules
from .conversation.syntax import read_json
from .types import EngineConfig, GenerationRequest, ImageInput, parameter_name

MAX_TEMPERATURE = 2.0
INT64_MAX = 2 ** 63 - 1
TEXT_ONLY_TARGET = 'the target reads text only (it has no vision tower)'


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings; temperature 0 means greedy."""

    temperature: float = 0.0
    top_k: int = 0      # 0 = off
    top_p: float = 0.0  # 0 = off

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class RequestPlan:
    """A validated request with its prompt tokenized, ready to run."""

    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    stops: list[str]
    seed: int
    drafter: str
    pinned_k: int        # > 0: fixed K, no adaptation or gating
    compiled_grammar: object | None = None  # the compiled json_schema / grammar (grammar.ConstraintCompiler); None
    images: tuple[ImageInput, ...] = ()     # the images in the order of their placeholder runs in prompt_ids
    reply: ReplyRules = ReplyRules()        # thinking and tool calls
    tools: tuple[tool_rules.ToolSpec, ...] = ()
    compiled_calls: object | None = None    # the compiled grammar of one call's body (tools on)
    output_check: object | None = None      # a json_schema's final check (logits.schema.OutputCheck); None without


def check_sampling(request: GenerationRequest) -> SamplingParams:
    """Return the request's sampling settings, or raise ValueError naming the field and its range."""
    temperature = float(request.temperature)
    if not math.isfinite(temperature) or not 0.0 <= temperature <= MAX_TEMPERATURE:
        raise ValueError('temperature must be a finite number in [0, {:g}] (0 = greedy), got {}'.format(
            MAX_TEMPERATURE, request.temperature))
    top_p = float(request.top_p)
    if top_p != 0.0 and not (math.isfinite(top_p) and 0.0 < top_p <= 1.0):
        raise ValueError('top_p must be in (0, 1] when set (0 = off), got {}'.format(request.top_p))
    if request.top_k < 0:
        raise ValueError('top_k must be >= 0 (0 = off), got {}'.format(request.top_k))
    return SamplingParams(temperature, int(request.top_k), top_p)


def check_prompt_size(request: GenerationRequest, config: EngineConfig) -> None:
    """Raise ValueError when a text prompt or the messages are longer than max_prompt_chars."""
    if request.prompt_ids:
        return
    characters = sum(len(str(m.get('content', ''))) for m in request.messages if isinstance(m, dict)) \
        if request.messages else len(request.prompt)
    characters += len(request.tools) if isinstance(request.tools, str) else 0   # declared in the prompt too
    if characters > config.max_prompt_chars:
        raise ValueError('{} {} characters, more than {} = {}'.format(
            'messages and tools have' if request.tools else 'messages have' if request.messages else 'prompt has',
            characters, parameter_name('max_prompt_chars'), config.max_prompt_chars))


def check_image_count(count: int, max_images: int, field: str = 'images') -> None:
    """Refuse more images than generation.max_images_per_goal (0 refuses every image)."""
    if count > max_images:
        raise ValueError('{}: {} images, more than {} = {}'.format(
            field, count, parameter_name('max_images_per_goal'), max_images))


def check_image_size(field: str, width: int, height: int, max_pixels: int) -> None:
    """Refuse an empty image, or one of more than generation.max_image_pixels pixels; field names it."""
    if width <= 0 or height <= 0:
        raise ValueError('{}: empty image ({}x{} pixels)'.format(field, width, height))
    if width * height > max_pixels:
        raise ValueError('{}: {}x{} = {} pixels, more than {} = {}'.format(
            field, width, height, width * height, parameter_name('max_image_pixels'), max_pixels))


def check_image_indices(messages: list | None, count: int, key: str = 'images') -> None:
    """
    Check that the messages show each of count images, by indices in range; ValueError naming the field.

    key: what errors call a message's list of indices ('image_indices' for a ROS goal's ChatMessage).
    """
    if count and not messages:
        raise ValueError('images need chat messages that show them (a message\'s {}): a raw prompt cannot place '
                         'them'.format(key))
    shown = set()
    for index, message in enumerate(messages or ()):
        indices = message.get('images', ()) if isinstance(message, dict) else ()
        if not isinstance(indices, list | tuple):
            raise ValueError('messages[{}].{} must be a list of image indices, got {!r}'.format(index, key, indices))
        for position, image in enumerate(indices):
            if isinstance(image, bool) or not isinstance(image, int) or not 0 <= image < count:
                raise ValueError('messages[{}].{}[{}]: {!r} is not an index into the {} image(s)'.format(
                    index, key, position, image, count))
            shown.add(image)
    unshown = sorted(set(range(count)) - shown)
    if unshown:
        raise ValueError('image(s) {} are shown by no message: list them in a message\'s {}'.format(unshown, key))


def check_images(request: GenerationRequest, config: EngineConfig, prompt_takes_images: bool = False) -> None:
    """
    Check a request's images: count, sizes, pixel bytes, and the messages that show them.

    prompt_takes_images: a raw prompt (no messages) may carry images, which go first (the local engine).
    """
    check_image_count(len(request.images), config.max_images_per_goal)
    for index, image in enumerate(request.images):
        field = 'images[{}]'.format(index)
        check_image_size(field, image.width, image.height, config.max_image_pixels)
        if len(image.rgb) != 3 * image.width * image.height:
            raise ValueError('{}.rgb: {} bytes, expected 3 x {} x {} = {}'.format(
                field, len(image.rgb), image.width, image.height, 3 * image.width * image.height))
    if request.messages or not prompt_takes_images:
        check_image_indices(request.messages, len(request.images))


def check_fields(request: GenerationRequest, config: EngineConfig) -> SamplingParams:
    """Check the fields every backend checks alike (stop strings, sampling, seed); return the sampling settings."""
    if len(request.stop) > config.max_stop_strings:
        raise ValueError('request has {} stop strings, more than {} = {}'.format(
            len(request.stop), parameter_name('max_stop_strings'), config.max_stop_strings))
    if any(not stop for stop in request.stop):
        raise ValueError('stop strings must not be empty')
    sampling = check_sampling(request)
    if not -1 <= request.seed <= INT64_MAX:
        raise ValueError('seed must be between 0 and {} (int64), or -1 for a random seed, got {}'.format(
            INT64_MAX, request.seed))
    if request.json_schema and isinstance(request.json_schema, str):
        read_json(request.json_schema, 'json_schema')   # the schema readers fail on infinite numbers, deep nesting
    return sampling


@dataclass(frozen=True)
class PlanContext:
    """What a request is planned against: the engine's target, limits, drafters and compilers, as they are now."""

    tokenizer: object
    vocab_size: int
    context_limit: int
    config: EngineConfig
    drafters: tuple[str, ...]      # the drafters a goal may pick (loaded, not disabled)
    default_drafter: str
    default_k: int                 # 0: adaptive
    constraints: object            # logits.grammar.ConstraintCompiler
    vision: object | None = None   # the target's runtime VisionTower; None: it reads text only


def plan_request(request: GenerationRequest, context: PlanContext) -> RequestPlan:
    """Validate a request, tokenize its prompt and compile its constraint; ValueError with a message for planners."""
    tokenizer, config, vision, constraints = context.tokenizer, context.config, context.vision, context.constraints
    sampling = check_fields(request, config)
    if request.images and vision is None:
        raise ValueError('images: {}'.format(TEXT_ONLY_TARGET))
    check_images(request, config, prompt_takes_images=True)
    drafter = request.drafter or context.default_drafter
    check_drafter(drafter, context.drafters)
    check_num_draft_tokens(request.num_draft_tokens, config)
    tools, reply = reply_rules(request, ConversationTokens.of(tokenizer.get_vocab()))
    check_prompt_size(request, config)
    ids = prompt_ids(request, tokenizer, context.vocab_size, vision, tools)
    max_new = request.max_new_tokens or config.max_new_tokens
    if request.max_new_tokens:
        check_max_new_tokens(request.max_new_tokens, config)
    if len(ids) + max_new > context.context_limit:
        raise ValueError('prompt ({} tokens) + max_new_tokens ({}) exceeds the context limit of {} tokens ({}, at '
                         'most the model context); shorten the prompt or lower max_new_tokens'.format(
                             len(ids), max_new, context.context_limit, parameter_name('context_limit')))
    pinned = request.num_draft_tokens or context.default_k
    seed = request.seed if request.seed >= 0 else int.from_bytes(os.urandom(4), 'little')
    if request.seed >= 0 and not sampling.greedy and not pinned:
        # adaptive K follows measured timings, which would change the random draws: pin K so that the same
        # seed reproduces the same output
        pinned = max(1, config.max_draft_tokens // 2)
    compiled = constraints.compile_request(request.json_schema, request.grammar,  # cached per text
                                           request.json_free_whitespace, request.json_schema_unenforced,
                                           number_digits(config))
    calls = constraints.compile_calls(tools, reply.forced_tool) if reply.calls else None
    return RequestPlan(ids, max_new, sampling, list(request.stop), seed, drafter, pinned, compiled,
                       shown_images(request.images, request.messages), reply, tools, calls,
                       constraints.output_check(request.json_schema, request.json_schema_unenforced))



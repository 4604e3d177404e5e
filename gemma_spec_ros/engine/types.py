"""
Typed config, requests, results and statistics of the engine: its public contract. Imports no torch.

EngineConfig fields carry their parameter metadata (description, limits or choices, run-time changeable, parameter
group); the node declares its ROS parameters from it and config_checks.check_config enforces it.
"""

import enum
import json
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

BACKENDS = ('local', 'vllm')
DEVICES = ('auto', 'cpu', 'cuda')
DTYPES = ('auto', 'float32', 'bfloat16', 'float16')
# how decode steps run: the lean forward on a static KV cache, eager, inductor-compiled or captured as CUDA graphs;
# off: transformers' own forward on a DynamicCache (the reference path, and the one for MoE checkpoints)
COMPILE_MODES = ('auto', 'inductor', 'inductor-gemm', 'cudagraph', 'eager', 'transformers')
# when compiled decode steps are built (steps/warmup.py): background (serve on eager steps at once, swap each graph
# in when ready), blocking (all before the first request) or off (each on first use, inside that request)
WARMUP_POLICIES = ('background', 'blocking', 'off')
# the engine ends with stop, length, tool_calls (the reply asks for its calls' results) or cancelled; the node adds
# error, busy (queue full) and timeout (queue.goal_timeout)
FINISH_REASONS = ('stop', 'length', 'tool_calls', 'cancelled', 'error', 'busy', 'timeout')
TOOL_CHOICES = ('auto', 'none', 'required')   # or a tool's name
INT32_MAX = 2 ** 31 - 1
# weight-only quantization of the target and the model drafters (runtime/quant/quantize.py)
QUANTIZATIONS = ('none', 'int8', 'int4', 'float16')


# the drafters by name (each one's class lives in engine/drafters/)
@dataclass(frozen=True)
class DrafterSpec:
    """Where a drafter lives and which EngineConfig field names its model directory ('' = needs no model)."""

    module: str        # module under gemma_spec_ros.engine.drafters (drafters.drafter_class imports it)
    class_name: str
    path_field: str    # EngineConfig field with the model directory, '' when the drafter has no model
    role: str          # what the model is called in messages


REGISTRY = {
    'none': DrafterSpec('none', 'NoneDrafter', '', 'plain decoding'),
    'mtp': DrafterSpec('mtp', 'MtpDrafter', 'assistant_path', 'MTP assistant'),
    'draft': DrafterSpec('draft_model', 'DraftModelDrafter', 'draft_model_path', 'draft model'),
    'ngram': DrafterSpec('ngram', 'NgramDrafter', '', 'prompt lookup'),
    'lookahead': DrafterSpec('lookahead', 'LookaheadDrafter', '', 'lookahead (the target\'s own predictions)'),
    'eagle3': DrafterSpec('eagle3', 'Eagle3Drafter', 'eagle3_path', 'EAGLE-3 head'),
}
AUTO = 'auto'  # not a drafter of its own: every round, the loaded drafter expected to be fastest (decoding/auto.py)
DRAFTERS = tuple(REGISTRY) + (AUTO,)  # what a goal or engine.drafter may name


def one_call_per_draft(num_drafts: int) -> int:
    """Drafter calls of a round of num_drafts drafts for a drafter that runs one step per call (Drafter.draft_calls)."""
    return num_drafts


def config_field(default, description: str, limits: tuple | None = None, choices: tuple | None = None,
               runtime: bool = False, group: str = 'engine'):
    """Make a config field with its parameter metadata: limits (min, max) for numbers, or choices for strings."""
    metadata = {'description': description, 'limits': limits, 'choices': choices, 'runtime': runtime,
                'group': group}
    return field(default=default, metadata=metadata)


@dataclass
class EngineConfig:
    """How to load and run the engine; the node's engine.* (and generation.* limits) parameters."""

    target_path: str = config_field('', 'Gemma 4 target directory: absolute, or relative to the working directory, '
                                  'the repository, or the installed share/gemma_spec_ros')
    drafter: str = config_field('mtp', 'default drafter: ' + '|'.join(DRAFTERS) + ' (changeable at run time)',
                              choices=DRAFTERS, runtime=True)
    assistant_path: str = config_field('', 'Gemma4AssistantForCausalLM directory for drafter mtp')
    draft_model_path: str = config_field('', 'smaller Gemma4ForCausalLM directory for drafter draft')
    eagle3_path: str = config_field('', 'EAGLE-3 head directory (train eagle3) for drafter eagle3')
    device: str = config_field('auto', 'auto|cpu|cuda or cuda:N (auto: cuda when available)')
    dtype: str = config_field('auto', 'auto|float32|bfloat16|float16 (auto: float32 on CPU, bfloat16 on CUDA)',
                            choices=DTYPES)
    quantization: str = config_field('none', 'weight-only quantization of the target and the model drafters, as they '
                                   'load: none, int8 (per channel), int4 (groups of 32 in the decoder layers, int8 '
                                   'elsewhere) or float16 (weights rounded to float16, products in the engine dtype); '
                                   'needs the lean forward (any engine.compile but transformers)',
                                   choices=QUANTIZATIONS)
    num_draft_tokens: int = config_field(0, 'K, tokens drafted per round; 0 = adaptive (changeable at run time)',
                                       limits=(0, 64), runtime=True)
    max_draft_tokens: int = config_field(8, 'upper bound for adaptive K', limits=(1, 64))
    ngram_min: int = config_field(1, 'smallest n-gram the prompt-lookup and lookahead drafters match', limits=(1, 64))
    ngram_max: int = config_field(3, 'largest n-gram the prompt-lookup and lookahead drafters match', limits=(1, 64))
    profit_gate: bool = config_field(True, 'pause speculation while no K >= 1 beats plain decoding')
    probe_interval: int = config_field(32, 'most verify rounds between probes while speculation is paused (a cheap '
                                         'drafter probes sooner)',
                                     limits=(1, INT32_MAX))
    max_new_tokens: int = config_field(128, 'tokens generated when a request says 0', limits=(1, INT32_MAX))
    max_new_tokens_limit: int = config_field(2048, 'largest max_new_tokens a request may ask for',
                                           limits=(1, INT32_MAX))
    num_threads: int = config_field(1, 'torch CPU threads; 0 = torch default (all cores: spin-waits when the cores '
                                  'are shared)', limits=(0, 1024))
    compile: str = config_field('auto', 'decode steps: auto (cudagraph on CUDA, inductor on CPU; off for models the '
                              'lean forward does not cover), inductor, inductor-gemm (CPU: verify passes through '
                              "inductor's GEMM template on frozen weights; faster, one more copy of the weights and "
                              'a compile at every start), cudagraph, eager (lean forward, static cache) '
                              "or transformers (transformers' own forward and DynamicCache)", choices=COMPILE_MODES)
    warmup: str = config_field('background', 'when compiled decode steps are built: background (serve at once on eager '
                             'steps, each graph takes over when ready), blocking (all before the first request: '
                             'minutes with a cold compile cache) or off (each on first use, inside that request)',
                             choices=WARMUP_POLICIES)
    max_batch: int = config_field(1, 'goals decoded together (continuous batching: a goal joins and leaves at a round '
                                'boundary, a KV-cache slot each); 1 = one goal at a time; 0 = as many as '
                                'engine.batch_kv_budget_mb holds (local backend)', limits=(0, 64))
    batch_kv_budget_mb: float = config_field(0.0, "MiB of the target's KV cache for the batch's slots, with "
                                             'engine.max_batch 0: the slots follow from it and engine.context_limit; '
                                             '0 = unset', limits=(0.0, 1048576.0))
    prefix_cache_mb: float = config_field(256.0, 'MiB of prompt-prefix K/V kept across goals (a long fixed system '
                                          'prompt is prefilled once; least recently used blocks go first), for the '
                                          'target and the draft model together; 0 = off (local fast path)',
                                          limits=(0.0, 1048576.0))
    row_product_max_rows: int = config_field(0, 'CPU inductor steps: the longest verify pass whose weight products are '
                                           'fused multiply-reduces, with a compiled graph per pass length up to it; '
                                           '0 = chosen for this CPU (1 on Intel, 4 with AVX2, 9 with AVX-512); lower '
                                           'means fewer graphs to compile, at some speed', limits=(0, 64))
    context_limit: int = config_field(4096, 'most tokens (prompt + generated) of one request; the static KV cache is '
                                    "preallocated for it (at most the model's max_position_embeddings)",
                                    limits=(16, INT32_MAX))
    json_integer_digits: int = config_field(15, 'most digits before the decimal point of a number in json_schema '
                                          'output (and of an integer); 0 = unbounded', limits=(0, 64))
    json_fraction_digits: int = config_field(6, 'most digits after the decimal point of a number in json_schema '
                                           'output (a model may otherwise write -1.0000... until its budget ends); '
                                           '0 = unbounded', limits=(0, 64))
    backend: str = config_field('local', 'local: this process runs the models; vllm: the vLLM server at vllm.url '
                              'serves every goal (engine.drafter and the model paths are then ignored)',
                              choices=BACKENDS)
    max_prompt_chars: int = config_field(32768, 'longest prompt (all messages together) a request may send',
                                       limits=(1, INT32_MAX), group='generation')
    max_stop_strings: int = config_field(16, 'most stop strings a request may send', limits=(0, 1024),
                                       group='generation')
    max_images_per_goal: int = config_field(4, 'most images a request may send (a target with a vision tower; 0 '
                                          'refuses images)', limits=(0, 64), group='generation')
    max_image_pixels: int = config_field(4096 * 4096, 'most pixels (width x height) of one image a request may send',
                                       limits=(1, INT32_MAX), group='generation')


def parameter_name(field_name: str) -> str:
    """Return the node parameter of an EngineConfig field, e.g. 'engine.drafter' or 'generation.max_prompt_chars'."""
    return '{}.{}'.format(EngineConfig.__dataclass_fields__[field_name].metadata['group'], field_name)


@dataclass(frozen=True)
class ImageInput:
    """One image of a goal, decoded: height x width RGB pixels, 3 bytes each, row-major (what the processor reads)."""

    width: int
    height: int
    rgb: bytes


@dataclass
class GenerationRequest:
    """One generation; field meanings follow gemma_spec_msgs/action/Generate."""

    prompt: str = ''                                   # raw text prompt (special tokens in it are parsed)
    prompt_ids: list[int] | None = None                # token ids instead of text
    messages: list[dict] | None = None                 # chat turns {"role", "content"[, "images"]}: content is
                                                       # plain text; images: indices into `images` shown before it
    max_new_tokens: int = 0                            # 0 = config default
    temperature: float = 0.0                           # 0 = greedy
    top_p: float = 0.0                                 # 0 = off
    top_k: int = 0                                     # 0 = off
    stop: list[str] = field(default_factory=list)      # stop strings
    seed: int = -1                                     # -1 = random
    drafter: str = ''                                  # '' = config default
    num_draft_tokens: int = 0                          # 0 = adaptive
    json_schema: str = ''                              # JSON Schema text the output must match; '' = unconstrained
    grammar: str = ''                                  # EBNF grammar (xgrammar syntax, rule root); at most one set
    json_free_whitespace: bool = False                 # json_schema output may hold whitespace between elements
                                                       # (bounded); False = compact JSON
    json_schema_unenforced: str = ''                   # a json_schema keyword the grammar cannot enforce: refuse
                                                       # ('' = refuse) or check (generate, validate at the end)
    images: tuple[ImageInput, ...] = ()                # camera frames the messages show (a target with a vision
                                                       # tower reads them at prefill)
    tools: str = ''                                    # JSON list of tools {name, description, parameters}; '' = none
    tool_choice: str = ''                              # auto|none|required|a tool's name; '' = auto with tools
    parallel_tool_calls: bool = True                   # False: at most one call per reply
    thinking: bool = False                             # the model may think first (thoughts go to reasoning)
    max_thinking_tokens: int = 0                       # thought tokens before the channel is closed; 0 = no budget
                                                       # (max_new_tokens still bounds the whole reply)


@dataclass(frozen=True)
class ToolCall:
    """One tool call of a reply: id 'call_<index>' (its place in the reply), the tool, its arguments as JSON text."""

    id: str
    name: str
    arguments: str

    def argument_values(self) -> dict:
        """Return the arguments as a dict."""
        return json.loads(self.arguments)


@dataclass
class StreamDelta:
    """What one verify round added to the output."""

    text: str                 # new answer text (never a broken UTF-8 sequence)
    token_ids: list[int]      # new token ids
    tokens_generated: int     # tokens generated so far
    tau: float                # running tokens per verify round
    reasoning: str = ''       # new thought text (thinking on)
    tool_calls: list[ToolCall] = field(default_factory=list)  # calls completed this round


@dataclass
class GenerationStats:
    """Measured statistics of one generation; tau counts the bonus token."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    target_passes: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    tau: float = 0.0
    acceptance_rate: float = 0.0
    per_position_acceptance: list[float] = field(default_factory=list)  # [K]
    mean_num_draft_tokens: float = 0.0
    rounds_by_draft_length: list[int] = field(default_factory=list)  # [max drafts + 1] decode rounds that drafted
                                                                     # k tokens (k = 0: a plain round)
    draft_cost_ratio: float = 0.0      # measured c
    drafter: str = 'none'              # drafter actually used ('auto': the drafter was chosen per round)
    rounds_by_drafter: dict[str, int] = field(default_factory=dict)  # decode rounds by the drafter that drafted
                                                                     # them ('none': rounds that drafted nothing)
    paused_rounds: int = 0             # decode rounds run plain because the profit gate paused speculation
    time_to_first_token: float = 0.0   # seconds
    inter_token_latency_p50: float = 0.0
    inter_token_latency_p95: float = 0.0
    tokens_per_second: float = 0.0     # decode rate after the first token
    wall_time: float = 0.0
    process_peak_rss_bytes: int = 0    # process RSS high-water mark since the process started
    cuda_peak_allocated_bytes: int = 0  # peak CUDA memory allocated during this generation (0 on CPU)
    cuda_peak_reserved_bytes: int = 0   # peak CUDA memory reserved during this generation (0 on CPU)
    decode_path: str = ''              # what ran the decode steps: the compile mode, eager, or both while warming up
    cached_prompt_tokens: int = 0      # prompt tokens whose K/V came from the prefix cache (not prefilled)
    image_prefill_ms: float = 0.0      # the vision tower and embedder on the goal's images, before the target's
                                       # prefill (part of time_to_first_token); 0 without images


class WarningKind(enum.Enum):
    """What a result's warning is about: what programs (diagnostics, logs) test instead of its text."""

    DRAFTER_FALLBACK = 'drafter_fallback'          # the drafter failed or cannot serve: plain decoding ran
    STRUCTURE_INCOMPLETE = 'structure_incomplete'  # max_new_tokens ended a json_schema / grammar / tool-call reply
    DROPPED_TOOL_CALL = 'dropped_tool_call'        # a call the request did not allow was left out of tool_calls
    SERVER_WIDE_FIGURES = 'server_wide_figures'    # vLLM: tau and acceptance include other requests' rounds
    CONFIGURATION = 'configuration'                # a setting the backend serves otherwise than asked (at open)
    UNENFORCED_KEYWORD = 'unenforced_keyword'      # json_schema_unenforced check: a keyword left to the final check
    SCHEMA_VIOLATION = 'schema_violation'          # the output completed the grammar but fails its json_schema


class GenerationWarning(str):
    """A warning of a result or a backend: its text (what a ROS result carries), and its kind for programs."""

    kind: WarningKind

    def __new__(cls, kind: WarningKind, text: str) -> 'GenerationWarning':
        warning = super().__new__(cls, text)
        warning.kind = kind
        return warning

    def __getnewargs__(self):   # copy and pickle rebuild it through __new__
        return self.kind, str(self)


def structure_incomplete(max_new_tokens: int) -> GenerationWarning:
    return GenerationWarning(WarningKind.STRUCTURE_INCOMPLETE, 'structure incomplete: max_new_tokens ({}) ended the '
                             'output before it completed its json_schema / grammar / tool calls'.format(max_new_tokens))


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str                 # one of FINISH_REASONS
    stats: GenerationStats
    warnings: list[GenerationWarning] = field(default_factory=list)  # e.g. the drafter failed: plain decoding ran
    structure_complete: bool = False   # the output completed the request's json_schema / grammar / tool calls
                                       # (False without); a json_schema output validates against it
    reasoning: str = ''                # the thoughts, apart from text (thinking on)
    tool_calls: list[ToolCall] = field(default_factory=list)  # with finish_reason tool_calls: run them, send results


class CancelToken:
    """Cooperative cancellation that another thread can trigger; checked once per verify round."""

    def __init__(self):
        self._event = threading.Event()

    def cancel(self) -> None:
        self._event.set()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()


DeltaCallback = Callable[[StreamDelta], None]


@dataclass(frozen=True)
class DisabledDrafter:
    """A drafter whose model failed to load; requests for it run plain decoding with a warning."""

    name: str    # drafter name, e.g. 'mtp'
    role: str    # what its model is, e.g. 'MTP assistant'
    path: str    # the model directory that failed
    cause: str   # the load error

    def describe(self) -> str:
        return 'drafter {!r} disabled ({} {}): {}'.format(self.name, self.role, self.path, self.cause)


@dataclass
class WarmupState:
    """Where the warm-up of the compiled decode steps stands."""

    policy: str = 'off'             # WARMUP_POLICIES
    graphs_ready: int = 0           # graphs built in the background so far (blocking: all of them)
    graphs_total: int = 0           # graphs a background warm-up builds (0: none; blocking: as many as ready)
    seconds: float = 0.0            # warm-up time so far; once done, the time to full speed
    default_path_seconds: float | None = None  # when the graphs of the target and the default drafter all served
    done: bool = True
    failed: list[str] = field(default_factory=list)  # graphs that failed to build: their steps stay eager

    @property
    def serving(self) -> str:
        """What the decode steps run on now: compiled, partly compiled (k of n graphs) or eager."""
        if self.policy == 'off':
            return 'compiled on first use'
        if self.graphs_ready and self.graphs_ready >= self.graphs_total:
            return 'compiled'
        return 'partly compiled ({} of {} graphs)'.format(self.graphs_ready, self.graphs_total) \
            if self.graphs_ready else 'eager'


@dataclass
class BatchGoalStatus:
    """One goal decoding in the batch (engine.max_batch > 1), as /diagnostics shows it."""

    slot: int                          # its KV-cache slot
    drafter: str                       # what it drafts with ('none': plain decoding)
    num_draft_tokens: int              # K of its latest round (0: a plain round)
    speculating: bool                  # False while its profit gate pauses it, or without a drafter
    tau: float                         # its tokens per target pass so far (NaN before its first pass)
    new_tokens: int                    # tokens it generated so far
    slot_wait: float                   # seconds it waited in the engine for its slot


@dataclass
class PrefixCacheStatus:
    """The prefix cache of the target (the draft model keeps one of its own), as /diagnostics shows it."""

    lookups: int = 0                   # goals prefilled through it
    hits: int = 0                      # ... that reused at least one block
    tokens_reused: int = 0             # prompt tokens not prefilled, over all goals
    nbytes: int = 0                    # K/V held now (target and draft model)
    budget_bytes: int = 0              # engine.prefix_cache_mb
    evictions: int = 0                 # blocks dropped for room

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else math.nan


@dataclass
class EngineStatus:
    """A snapshot of the engine for diagnostics; safe to read from another thread."""

    backend: str = 'local'             # which backend (Capabilities.backend) took this snapshot
    target_id: str = ''                # target directory name
    drafter_id: str = ''               # drafter directory name ('' for ngram/none)
    drafter: str = 'none'              # configured default drafter
    device: str = 'cpu'
    dtype: str = 'float32'
    compile_mode: str = 'transformers'  # how decode steps run (engine.compile resolved for this device and model)
    warmup: WarmupState = field(default_factory=WarmupState)
    weights_bytes: int = 0             # parameters of every loaded model
    kv_cache_bytes: int = 0            # static KV caches (preallocated for engine.context_limit; 0 when off)
    kv_cache_slot_bytes: int = 0       # the target's KV cache per batch slot (engine.max_batch > 1; else 0)
    prefix_cache: PrefixCacheStatus | None = None  # the target's prefix cache (None: off, or another backend)
    batch_slots: int = 0               # the batch's KV-cache slots (engine.max_batch, or what its budget holds)
    batch_goals: list[BatchGoalStatus] = field(default_factory=list)  # the goals in the batch now, by slot
    num_draft_tokens: int = 0          # K the adaptive controller would use now
    draft_cost_ratio: float = 0.0      # measured c
    break_even_tau: float = 1.0        # tau needed to beat plain decoding at this K: 1 + K*c (verify-cost adjusted)
    speculating: bool = False          # False while the profit gate has paused speculation
    tau_lifetime: float = math.nan              # over the generations that speculated; NaN before the first
    acceptance_rate_lifetime: float = math.nan  # accepted / drafted over them; NaN before the first draft
    disabled_drafters: list[DisabledDrafter] = field(default_factory=list)  # drafters that failed to load

"""Typed requests, results and statistics of the engine. This module is the engine's public contract."""

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

DRAFTERS = ('none', 'mtp', 'draft', 'ngram')
FINISH_REASONS = ('stop', 'length', 'cancelled', 'error')


@dataclass
class EngineConfig:
    """How to load and run the engine; mirrors the node's ``engine.*`` parameters."""

    target_path: str                  # directory with a Gemma 4 target (safetensors + config + tokenizer)
    drafter: str = 'mtp'              # default drafter: none|mtp|draft|ngram
    assistant_path: str = ''          # Gemma4AssistantForCausalLM directory (drafter mtp)
    draft_model_path: str = ''        # smaller Gemma4ForCausalLM directory (drafter draft)
    device: str = 'auto'              # auto|cpu|cuda
    dtype: str = 'auto'               # auto|float32|bfloat16|float16 (auto: float32 on CPU, bfloat16 on CUDA)
    num_draft_tokens: int = 0         # K; 0 = adaptive
    max_draft_tokens: int = 8         # upper bound for adaptive K
    ngram_min: int = 1                # smallest n-gram the prompt-lookup drafter matches
    ngram_max: int = 3                # largest n-gram the prompt-lookup drafter matches
    profit_gate: bool = True          # pause speculation when no K >= 1 beats plain decoding
    probe_interval: int = 32          # rounds between probes while speculation is paused
    max_new_tokens: int = 128         # default when a request says 0
    max_new_tokens_limit: int = 2048  # largest max_new_tokens a request may ask for
    num_threads: int = 0              # torch CPU threads; 0 = torch default


@dataclass
class GenerationRequest:
    """One generation; field meanings follow gemma_spec_msgs/action/Generate."""

    prompt: str = ''                                   # raw text prompt
    prompt_ids: list[int] | None = None                # token ids instead of text
    messages: list[dict[str, str]] | None = None       # chat turns {"role", "content"}
    max_new_tokens: int = 0                            # 0 = config default
    temperature: float = 0.0                           # 0 = greedy
    top_p: float = 0.0                                 # 0 = off
    top_k: int = 0                                     # 0 = off
    stop: list[str] = field(default_factory=list)      # stop strings
    seed: int = -1                                     # -1 = random
    drafter: str = ''                                  # '' = config default
    num_draft_tokens: int = 0                          # 0 = adaptive


@dataclass
class StreamDelta:
    """What one verify round added to the output."""

    text: str                 # new text (never a broken UTF-8 sequence)
    token_ids: list[int]      # new token ids
    tokens_generated: int     # tokens generated so far
    tau: float                # running tokens per verify round


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
    draft_cost_ratio: float = 0.0      # measured c
    drafter: str = 'none'              # drafter actually used
    paused_rounds: int = 0             # decode rounds run plain because the profit gate paused speculation
    time_to_first_token: float = 0.0   # seconds
    inter_token_latency_p50: float = 0.0
    inter_token_latency_p95: float = 0.0
    tokens_per_second: float = 0.0     # decode rate after the first token
    wall_time: float = 0.0
    peak_memory_bytes: int = 0         # process RSS high-water mark
    cuda_allocated_bytes: int = 0
    cuda_reserved_bytes: int = 0


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str                 # one of FINISH_REASONS
    stats: GenerationStats
    warnings: list[str] = field(default_factory=list)  # e.g. drafter failed, fell back to plain decoding


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


@dataclass
class EngineStatus:
    """A snapshot of the engine for diagnostics; safe to read from another thread."""

    target_id: str = ''                # target directory name
    drafter_id: str = ''               # drafter directory name ('' for ngram/none)
    drafter: str = 'none'              # configured default drafter
    device: str = 'cpu'
    dtype: str = 'float32'
    num_draft_tokens: int = 0          # K the adaptive controller would use now
    draft_cost_ratio: float = 0.0      # measured c
    break_even_tau: float = 1.0        # tau needed to beat plain decoding at this K: 1 + K*c (verify-cost adjusted)
    speculating: bool = False          # False while the profit gate has paused speculation
    tau_lifetime: float = 0.0
    acceptance_rate_lifetime: float = 0.0

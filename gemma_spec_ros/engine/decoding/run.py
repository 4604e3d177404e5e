"""The state of one generation (Run, made by new_run), and where a round's tokens end it (end_of_output)."""

from dataclasses import dataclass, field

import torch

from ..control import SpeculationController
from ..drafters.base import Drafter
from ..logits.grammar import GrammarConstraint
from ..requests import RequestPlan
from ..stats import RoundTally
from .calibration import Stopwatch
from .stream import IncrementalDetokenizer, StopStrings


@dataclass
class Run:
    """The mutable state of one generation."""

    plan: RequestPlan
    drafter: Drafter
    controller: SpeculationController | None  # None: plain decoding (drafter 'none' or after a fallback)
    generator: torch.Generator
    detokenizer: IncrementalDetokenizer
    stops: StopStrings
    tokens: list[int]                  # prompt + generated; the last one is not in the target cache yet
    stopwatch: Stopwatch
    last_token: torch.Tensor | None = None  # [1] tokens[-1] on the device (saves a host-to-device copy per round)
    constraint: GrammarConstraint | None = None  # the request's json_schema / grammar, advanced by emitted tokens
    generated: list[int] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)      # streamed text, one piece per delta
    warnings: list[str] = field(default_factory=list)
    tally: RoundTally = field(default_factory=RoundTally)
    finish: str = ''

    def fall_back(self, plain: Drafter, exc: Exception) -> None:
        """Continue this request with plain decoding after the drafter raised."""
        self.warnings.append('drafter {!r} failed ({}: {}); fell back to plain decoding'.format(
            self.drafter.name, type(exc).__name__, exc))
        self.drafter, self.controller = plain, None


def end_of_output(new_tokens: list[int], eos_ids: set[int], num_generated: int, max_new: int) -> tuple[list[int], str]:
    """Truncate a round's tokens at EOS (kept) or at max_new_tokens; returns (tokens, finish reason or '')."""
    for index, token in enumerate(new_tokens):
        if token in eos_ids and num_generated + index < max_new:
            return new_tokens[:index + 1], 'stop'
    room = max_new - num_generated
    if len(new_tokens) >= room:
        return new_tokens[:room], 'length'
    return new_tokens, ''


def new_run(plan: RequestPlan, drafter: Drafter, tokenizer, device: torch.device) -> Run:
    """Make the Run of a plan (its generator seeded, its stream state fresh), drafting with drafter."""
    return Run(plan=plan, drafter=drafter, controller=None,
               generator=torch.Generator(device=device).manual_seed(plan.seed),
               detokenizer=IncrementalDetokenizer(tokenizer), stops=StopStrings(plan.stops),
               tokens=list(plan.prompt_ids), stopwatch=Stopwatch(device))

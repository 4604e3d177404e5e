"""The state of one generation (Run, made by new_run), and where a round's tokens end it (end_of_output)."""

from dataclasses import dataclass, field

import torch

from ..control import SpeculationController
from ..conversation.format import ConversationTokens
from ..drafters.base import Drafter
from ..logits.grammar import GrammarConstraint
from ..logits.reply import ReplyConstraint
from ..logits.schema import check_output
from ..requests import RequestPlan
from ..stats import RoundTally, tau
from ..types import (
    DeltaCallback,
    GenerationResult,
    GenerationStats,
    GenerationWarning,
    StreamDelta,
    ToolCall,
    WarningKind,
    structure_incomplete,
)
from .auto import AutoDrafting
from .calibration import Stopwatch
from .stream import ReplyStream, StopStrings


@dataclass
class Run:
    """The mutable state of one generation."""

    plan: RequestPlan
    drafter: Drafter
    controller: SpeculationController | None  # None: plain decoding (drafter 'none' or after a fallback)
    generator: torch.Generator
    reply: ReplyStream                 # the reply's text, thoughts and tool calls
    stops: StopStrings                 # on the answer's text
    tokens: list[int]                  # prompt + generated; the last one is not in the target cache yet
    stopwatch: Stopwatch
    last_token: torch.Tensor | None = None  # [1] tokens[-1] on the device (saves a host-to-device copy per round)
    constraint: GrammarConstraint | ReplyConstraint | None = None  # json_schema / grammar / the reply's shape,
                                                                    # advanced by emitted tokens
    generated: list[int] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)      # streamed text, one piece per delta
    thoughts: list[str] = field(default_factory=list)    # streamed thought text
    warnings: list[GenerationWarning] = field(default_factory=list)
    tally: RoundTally = field(default_factory=RoundTally)
    finish: str = ''
    auto: AutoDrafting | None = None   # drafter auto: its members; drafter and controller are then the round's

    def drafters(self) -> list[Drafter]:
        """Return the drafters that see the goal's passes: an auto goal's members, else its drafter."""
        return self.auto.members() if self.auto is not None else [self.drafter]

    def speculators(self) -> list[tuple[Drafter, SpeculationController]]:
        """Each drafter with its controller: an auto goal's members, else its drafter if it speculates."""
        if self.auto is not None:
            return [(self.auto.drafters[name], controller) for name, controller in self.auto.controllers.items()]
        return [] if self.controller is None else [(self.drafter, self.controller)]

    @property
    def speculates(self) -> bool:
        """Whether the goal speculates (False: drafter none, or after a fallback)."""
        return self.auto is not None or self.controller is not None

    @property
    def needs_target_states(self) -> bool:
        return any(drafter.needs_target_states for drafter in self.drafters())

    def result(self, stats: GenerationStats) -> GenerationResult:
        """Return the generation's result: text, thoughts, tool calls, and whether its structure completed."""
        complete = self.constraint is not None and self.constraint.completed and not self.stops.stopped
        if self.finish != 'tool_calls':   # a json_schema answer validates, or it is not complete
            complete = check_output(self.plan.output_check, ''.join(self.pieces), complete, self.warnings)
        structured = self.constraint is not None and getattr(self.constraint, 'structured', True)
        if structured and self.finish == 'length' and not complete:
            self.warnings.append(structure_incomplete(self.plan.max_new_tokens))
        # calls count only when the reply asked for their results: a cut-off reply's calls are not a plan to run
        calls = self.reply.calls if self.finish == 'tool_calls' else []
        return GenerationResult(''.join(self.pieces), self.generated, self.finish, stats,
                                self.warnings + self.reply.warnings, complete, ''.join(self.thoughts), list(calls))

    def release_held(self) -> tuple[str, str]:
        """At the end: incomplete characters and possible stop-string prefixes that were held back; and thoughts."""
        text, thought = self.reply.flush()
        text = self.stops.feed(text)
        return (text if self.stops.stopped else text + self.stops.flush()), thought

    def send(self, text: str, token_ids: list[int], on_delta: DeltaCallback | None, thought: str = '',
             calls: list[ToolCall] | None = None) -> None:
        """Stream a round's text, thoughts and completed calls."""
        self.pieces.append(text)
        self.thoughts.append(thought)
        if on_delta is not None:
            on_delta(StreamDelta(text, token_ids, len(self.generated), tau(len(self.generated),
                                                                          self.tally.target_passes),
                                 thought, list(calls or ())))

    def fall_back(self, plain: Drafter, exc: Exception, drafter: Drafter | None = None) -> None:
        """Continue with plain decoding after the drafter raised (an auto goal: without that member, if one)."""
        drafter = drafter or self.drafter
        member = self.auto is not None and self.auto.drop(drafter)
        self.warnings.append(GenerationWarning(WarningKind.DRAFTER_FALLBACK, 'drafter {!r} failed ({}: {}); {}'.format(
            drafter.name, type(exc).__name__, exc, 'auto goes on without it' if member else
            'fell back to plain decoding')))
        if not member:
            self.auto = None
        if not member or drafter is self.drafter:
            self.drafter, self.controller = plain, None


def end_of_output(new_tokens: list[int], eos_ids: set[int], num_generated: int, max_new: int,
                  asks_results: int | None = None) -> tuple[list[int], str]:
    """
    Truncate a round's tokens at EOS (kept) or at max_new_tokens; returns (tokens, finish reason or '').

    asks_results: the stop token that ends a reply with tool calls (<|tool_response>): finish reason tool_calls.
    """
    for index, token in enumerate(new_tokens):
        if token in eos_ids and num_generated + index < max_new:
            return new_tokens[:index + 1], 'tool_calls' if token == asks_results else 'stop'
    room = max_new - num_generated
    if len(new_tokens) >= room:
        return new_tokens[:room], 'length'
    return new_tokens, ''


def new_run(plan: RequestPlan, drafter: Drafter, tokenizer, device: torch.device,
            conversation: ConversationTokens) -> Run:
    """Make the Run of a plan (its generator seeded, its stream state fresh), drafting with drafter."""
    return Run(plan=plan, drafter=drafter, controller=None,
               generator=torch.Generator(device=device).manual_seed(plan.seed),
               reply=ReplyStream(tokenizer, conversation, plan.tools), stops=StopStrings(plan.stops),
               tokens=list(plan.prompt_ids), stopwatch=Stopwatch(device))

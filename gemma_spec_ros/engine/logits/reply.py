"""
The token masks that keep a reply in Gemma 4's shape: thoughts within their budget, then an answer or tool calls.

A reply passes through phases; each allows a set of next tokens:

    start     (thinking on) <|channel>: a reply with thinking on thinks first
    resume    (thinking on, the reply goes on with the model's turn after tool results) <|channel> or whatever
              the answer allows: the turn's thoughts came first, before its calls
    thought   ordinary tokens or <channel|>; once max_thinking_tokens tokens are in the channel (its 'thought'
              label too), only <channel|>
    answer    the json_schema / grammar's tokens, or ordinary text and the turn's end; with tool_choice auto also
              <|tool_call>, with required or a tool's name only <|tool_call>
    call      the tool call's grammar (tools.call_grammar: a declared name, arguments valid under its schema)
              until <tool_call|>
    called    another <|tool_call> (unless parallel_tool_calls is off), or <|tool_response>: the reply ends and
              asks for the calls' results

Like a JSON Schema's grammar, the masks apply to the target's logits before verify(), and drafters draw under the
same masks (Lookahead), so speculation stays lossless. Closing the thought channel at the budget is such a mask:
the reply is the target's own distribution conditioned on the rule that the channel closes there, the same for
every drafter, and greedy decoding takes the target's argmax under it.
"""

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..conversation.format import ConversationTokens
from ..conversation.reply import ReplyRules
from .grammar import ConstraintCompiler, GrammarConstraint, Lookahead, allowed_prefix_len

START, RESUME, THOUGHT, ANSWER, CALL, CALLED, DONE = 'start', 'resume', 'thought', 'answer', 'call', 'called', 'done'


@dataclass(frozen=True)
class _State:
    phase: str
    thought_tokens: int
    call: GrammarConstraint | None   # the open (or last) call's grammar
    calls: int                       # calls closed
    moved: str = ''                  # which grammar the push moved: 'answer', 'call' or ''


class ReplyConstraint:
    """
    One request's position in its reply's shape; the same interface as grammar.GrammarConstraint.

    answer: the json_schema / grammar's constraint (None: free text); calls: the compiled grammar of a call's body
    (None: no tool calls). Stop ids: the answer's (a turn's end, EOS) and <|tool_response> after the calls.
    """

    def __init__(self, compiler: ConstraintCompiler, rules: ReplyRules, answer: GrammarConstraint | None,
                 calls=None):
        tokens: ConversationTokens = compiler.conversation
        self.vocab_size = vocab_size = compiler.vocab_size
        self._compiler, self._rules, self._answer, self._calls = compiler, rules, answer, calls
        self._tokens = tokens
        self._ends = list(compiler.stop_ids)               # an answer's ends: a turn's end, EOS
        text = torch.ones(vocab_size, dtype=torch.bool)
        text[list(compiler.special_ids)] = False
        self._text = text                                  # ordinary tokens (no special, no control token)
        self._free_answer = text.clone()
        self._free_answer[self._ends] = True
        self._thought = text.clone()
        if tokens.channel_close is not None:
            self._thought[tokens.channel_close] = True
        self._free_answer_or_call = self._free_answer.clone()
        if tokens.call_open is not None:
            self._free_answer_or_call[tokens.call_open] = True
        # special tokens a grammar never takes (checked here: xgrammar logs each one it refuses)
        special = frozenset(compiler.special_ids)
        self._blocked = {ANSWER: special - set(self._ends), CALL: special - {tokens.quote, tokens.call_close}}
        self._only: dict[tuple[int, ...], torch.Tensor] = {}   # tokens -> the mask allowing only them
        self._history: list[_State] = []
        first = (RESUME if rules.resumes else START) if rules.thinking else ANSWER
        self._state = _State(first, 0, None, 0)

    # ------------------------------------------------------------------------------------------- state
    @property
    def completed(self) -> bool:
        """The structure the request asked for is complete: its grammar's, or every call closed and asked for."""
        state = self._state
        if self._rules.calls and state.calls and state.phase in (CALLED, DONE):
            return True
        if self._answer is not None and state.phase in (ANSWER, DONE) and not state.calls:
            return self._answer.completed
        return False

    @property
    def terminated(self) -> bool:
        """A stop token was accepted: nothing may follow."""
        return self._state.phase == DONE

    @property
    def structured(self) -> bool:
        """The reply has a structure to complete: a grammar, required calls, or calls it began; not free text."""
        return self._answer is not None or self._rules.tool_choice == 'required' or \
            self._state.phase in (CALL, CALLED) or self._state.calls > 0

    @property
    def in_thought(self) -> bool:
        return self._state.phase == THOUGHT

    def reset(self) -> None:
        """Back to the start of the reply."""
        self.rollback(len(self._history))

    # ------------------------------------------------------------------------------------------- masks
    def next_mask(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Return the allowed tokens [1, vocab] bool for the next token."""
        return self._mask().unsqueeze(0).to(device)

    def _mask(self) -> torch.Tensor:
        state, tokens, rules = self._state, self._tokens, self._rules
        assert state.phase != DONE, 'no token may follow a stop token'
        if state.phase == THOUGHT:
            if rules.thinking_budget and state.thought_tokens >= rules.thinking_budget:
                return self._only_token(tokens.channel_close)
            return self._thought
        if state.phase == CALL:
            return state.call.next_mask()[0]
        if state.phase == CALLED:
            if not rules.parallel_calls:
                return self._only_token(tokens.response_open)
            return self._only_token(tokens.call_open, tokens.response_open)
        if state.phase == START:
            return self._only_token(tokens.channel_open)
        if state.phase == RESUME:
            mask = self._answer_mask().clone()
            mask[tokens.channel_open] = True
            return mask
        return self._answer_mask()

    def _answer_mask(self) -> torch.Tensor:
        if self._rules.tool_choice == 'required':
            return self._only_token(self._tokens.call_open)
        if self._answer is not None:
            return self._answer.next_mask()[0]
        if self._rules.calls:
            return self._free_answer_or_call
        return self._free_answer

    def _only_token(self, *tokens_: int) -> torch.Tensor:
        """Return the mask that allows only these tokens (made once)."""
        if tokens_ not in self._only:
            self._only[tokens_] = torch.zeros(self.vocab_size, dtype=torch.bool)
            self._only[tokens_][list(tokens_)] = True
        return self._only[tokens_]

    def masks_along(self, draft_tokens: Sequence[int] | torch.Tensor,
                    device: torch.device | str | None = None) -> tuple[torch.Tensor, int]:
        """Masks [k + 1, vocab] bool for every verify position of k drafts, and how many drafts are allowed."""
        draft = draft_tokens.tolist() if isinstance(draft_tokens, torch.Tensor) else list(draft_tokens)
        rows, allowed = [self._mask()], 0
        for token in draft:
            if not self.advance(token):
                break
            allowed += 1
            if self.terminated:
                break
            rows.append(self._mask())
        self.rollback(allowed)
        rows += [rows[-1]] * (len(draft) + 1 - len(rows))   # past a refused draft: never used, still valid rows
        return torch.stack(rows).to(device), allowed

    def allowed_prefix_len(self, tokens_: Sequence[int] | torch.Tensor) -> int:
        """How many leading tokens the reply's shape allows from here."""
        return allowed_prefix_len(self, tokens_)

    @contextmanager
    def lookahead(self) -> Iterator[Lookahead]:
        """Explore a draft token by token (model drafters); everything pushed is rolled back on exit."""
        look = Lookahead(self)
        try:
            yield look
        finally:
            self.rollback(look.pushed)

    def accept(self, tokens_: Iterable[int]) -> None:
        """Advance by emitted tokens (accepted drafts + recovered or bonus token, cut at a stop token)."""
        for token in tokens_:
            ok = self.advance(int(token))
            assert ok, 'token {} breaks the reply\'s shape: it was emitted without the mask'.format(token)

    # ------------------------------------------------------------------------------------------- moves
    def advance(self, token: int) -> bool:
        """Move past token; False (nothing changes) when the reply's shape does not allow it here."""
        state, tokens = self._state, self._tokens
        moved, phase, thought, call, calls = '', state.phase, state.thought_tokens, state.call, state.calls
        if phase == RESUME:   # thoughts again, or on as the answer
            phase = START if token == tokens.channel_open else ANSWER
        grammar = call if phase == CALL else self._answer if phase == ANSWER else None
        if phase == DONE or (grammar is None and not bool(self._mask()[token])):
            return False
        if grammar is not None and (token in self._blocked[phase] or not grammar.advance(token)):
            return False   # the grammar's own check: no mask to build
        if phase == START and token == tokens.channel_open:
            phase, thought = THOUGHT, 0
        elif phase == THOUGHT:
            if token == tokens.channel_close:
                phase = ANSWER
            else:
                thought += 1
        elif phase == CALL:
            moved = CALL
            if call.terminated:
                phase, calls = CALLED, calls + 1
        elif phase == CALLED:
            if token == tokens.response_open:
                phase = DONE
            else:
                phase, call = CALL, self._compiler.call_matcher(self._calls)
        elif token == tokens.call_open:   # in the answer
            phase, call = CALL, self._compiler.call_matcher(self._calls)
        elif grammar is not None:   # the answer's json_schema / grammar
            moved = ANSWER
            phase = DONE if grammar.terminated else ANSWER
        else:
            phase = DONE if token in self._ends else ANSWER
        self._history.append(state)
        self._state = _State(phase, thought, call, calls, moved)
        return True

    def rollback(self, count: int) -> None:
        """Undo the last count tokens that advance or accept moved past."""
        for _ in range(count):
            moved = self._state.moved
            if moved == ANSWER:
                self._answer.rollback(1)
            elif moved == CALL:
                self._state.call.rollback(1)
            self._state = self._history.pop()

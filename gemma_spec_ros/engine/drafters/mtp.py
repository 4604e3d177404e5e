"""The Gemma 4 MTP assistant: drafts from the target's last hidden state and K/V."""

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from ..requests import SamplingParams
from ..runtime import FastAssistant, FastCausalLM
from ..runtime.model import checkpoints
from ..runtime.quant.quantize import Quantizer
from ..runtime.steps import causal_lm
from ..runtime.steps.assistant import greedy_calls
from ..runtime.steps.rows import AssistantRows
from ..types import one_call_per_draft
from .base import (
    DraftContext,
    Drafter,
    DraftRound,
    DraftRows,
    LoadContext,
    Proposal,
    RowDraws,
    RowRequest,
    grammar_lookahead,
)


class MtpDrafter(Drafter):
    """
    Gemma4AssistantForCausalLM drafting from the target's last hidden state and K/V.

    Every draft step feeds [target embedding of the last token, hidden state] at the same position and attends the
    target's K/V of the tokens before it. On the fast path one step function reads the target's static cache (the
    rolled-back drafts are outside its masks), and greedy rounds without grammar or cut-off run several steps per
    call (FastAssistant.greedy_drafts); on transformers' path the assistant gets the shared K/V of each target
    pass, cut to the kept tokens. It stops early only at the confidence cut-off the adaptive controller calibrated
    for it (none unless replaying its rounds shows that one pays).
    """

    name = 'mtp'
    needs_target_states = True

    def __init__(self, assistant, target_lm, quantizer: Quantizer | None = None):
        self._assistant = assistant
        self._fast = FastAssistant(assistant, target_lm, target_lm.mode, quantizer) \
            if isinstance(target_lm, FastCausalLM) else None
        self.cut_saves_drafting = self._fast is None  # greedy rounds on the fast path draft in calls of several
        self._embed = target_lm.model.get_input_embeddings()
        self.weights_bytes = causal_lm.parameter_bytes(assistant) + (0 if quantizer is None else
                                                                     quantizer.report.bytes_after)
        self._hidden = None      # [1, 1, hidden] target state that predicted the last token
        self._shared_kv = None   # transformers' path: {layer_type: (keys, values)} up to the token before the last
        self._batch_rows: MtpRows | None = None  # drafting for a batch's goals (join_batch)

    @classmethod
    def load(cls, context: LoadContext) -> 'MtpDrafter':
        path = context.config.assistant_path
        context.progress('loading MTP assistant {}'.format(path))
        quantizer = Quantizer.for_mode(context.config.quantization)
        assistant = checkpoints.load_assistant(path, context.device, context.dtype, quantizer)
        checkpoints.check_same_vocab(context.target, context.tokenizer, assistant, path, 'MTP assistant')
        checkpoints.check_assistant_fits(context.target, assistant, path)
        drafter = cls(assistant, context.target_lm, quantizer)
        if quantizer is not None:
            context.progress(quantizer.report.describe('MTP assistant'))
        if drafter._fast is not None and drafter._fast.weights_dtype is not None:
            context.progress('MTP assistant: matrices stored as {} (exact), computed in float32'.format(
                str(drafter._fast.weights_dtype).replace('torch.', '')))
        return drafter

    def warmup(self, progress) -> int:
        if self._fast is None:
            return 0
        batched = 0 if self._batch_rows is None else self._batch_rows.runner.warmup(progress)
        return self._fast.warmup(progress).graphs + batched

    def graph_jobs(self) -> list:
        return [] if self._fast is None else self._fast.graph_jobs(self.name)

    def join_batch(self, target_rows) -> list | None:
        if self._fast is None:  # transformers' forward: no batched steps
            return None
        self._batch_rows = MtpRows(AssistantRows(self._fast, target_rows))
        return self._batch_rows.runner.graph_jobs('mtp batch')

    def for_batch(self, slot: int) -> 'MtpGoalDrafter':
        return MtpGoalDrafter(self._batch_rows)

    def start(self, prompt_ids: list[int]) -> None:
        self._hidden = None
        self._shared_kv = None

    def observe(self, target_out, num_fed: int, num_kept: int) -> None:
        if target_out.hidden is None:  # a pass without states (speculation paused): wait for the next
            self._hidden = self._shared_kv = None
            return
        self._hidden = target_out.hidden[:, num_kept - 1:num_kept]
        if self._fast is not None:
            return
        drop = num_fed - num_kept
        kv = target_out.shared_kv_states
        if drop:
            kv = {kind: (keys[..., :-drop, :], values[..., :-drop, :]) for kind, (keys, values) in kv.items()}
        self._shared_kv = kv

    def has_proposal(self, tokens: list[int]) -> bool:
        return self._hidden is not None  # the last pass returned its states

    def _drafts_in_calls(self, sampling: SamplingParams, constrained: bool) -> bool:
        """Greedy rounds on the fast path, with nothing to decide between steps, run several steps per call."""
        return self._fast is not None and sampling.greedy and not constrained

    def draft_calls(self, sampling: SamplingParams, constrained: bool) -> Callable[[int], int]:
        return greedy_calls if self._drafts_in_calls(sampling, constrained) else one_call_per_draft

    def propose(self, context: DraftContext, k: int) -> Proposal | None:
        if self._hidden is None:
            return None
        position = len(context.tokens) - 1
        if self._drafts_in_calls(context.sampling, context.constraint is not None):
            # nothing to decide between the steps: several per call, a cut-off checked after each call
            tokens, confidences = self._fast.greedy_drafts(context.last_token.view(1, 1), self._hidden, position, k,
                                                           context.min_confidence)
            return Proposal(tokens, None, confidences)
        token = context.last_token
        hidden = self._hidden
        with grammar_lookahead(context) as look, self._steps_at(position) as step:
            drafts = DraftRound(context, context.min_confidence, look)
            for _ in range(k):
                logits, hidden = step(token, hidden)
                token, more = drafts.draw(logits)
                if not more:
                    break
        return drafts.proposal()

    @contextmanager
    def _steps_at(self, position: int) -> Iterator[Callable[[torch.Tensor, torch.Tensor], tuple]]:
        """
        Yield the draft step of one round at position: step(token [1], hidden [1, 1, backbone]) -> logits, hidden.

        The logits are [1, vocab], the hidden feeds the next step. Every step of a round drafts at the same
        position: what the steps share (the position tensor) is set up once.
        """
        if self._fast is not None:
            with self._fast.drafting(position) as fast_step:
                def step(token, hidden):
                    out = fast_step(token.unsqueeze(0), hidden)
                    return out.logits[:, -1], out.hidden
                yield step
            return
        position_ids = torch.tensor([[position]], device=self._hidden.device)

        def step(token, hidden):
            inputs = torch.cat([self._embed(token.unsqueeze(0)), hidden], dim=-1)  # [1, 2 * hidden]
            out = self._assistant(inputs_embeds=inputs, position_ids=position_ids, shared_kv_states=self._shared_kv)
            return out.logits[:, -1], out.last_hidden_state
        yield step


class MtpGoalDrafter(Drafter):
    """One goal's MTP drafting in a batch: its target state; the drafts come from the batch's MtpRows."""

    name = 'mtp'
    needs_target_states = True

    def __init__(self, rows: 'MtpRows'):
        self.rows = rows
        self.hidden = None  # [1, 1, backbone] target state that predicted the goal's last token

    def start(self, prompt_ids: list[int]) -> None:
        self.hidden = None

    def observe(self, target_out, num_fed: int, num_kept: int) -> None:
        self.hidden = None if target_out.hidden is None else target_out.hidden[:, num_kept - 1:num_kept]

    def has_proposal(self, tokens: list[int]) -> bool:
        return self.hidden is not None

    def propose(self, context: DraftContext, k: int) -> Proposal | None:
        raise NotImplementedError('a goal in a batch drafts through its rows (MtpRows.propose_rows): the assistant '
                                  "reads the goal's own KV-cache slot")


class MtpRows(DraftRows):
    """
    MTP drafting for a batch: each draft step runs the assistant for every row at once (AssistantRows).

    Each goal draws its drafts from its row's logits as on its own (DraftRound: greedy, sampled, under its grammar).
    """

    def __init__(self, runner: AssistantRows):
        self.runner = runner

    def propose_rows(self, requests: list[RowRequest], batch: int) -> list[Proposal | None]:
        ready = [request for request in requests if request.drafter.hidden is not None]
        if not ready:
            return [None] * len(requests)
        device = ready[0].context.last_token.device
        _, hidden = self.runner.blank_inputs(batch)
        current, positions = [0] * batch, [1] * batch  # idle rows: any token, any valid position
        for request in ready:
            current[request.slot] = request.context.tokens[-1]
            hidden[request.slot] = request.drafter.hidden[0]
            positions[request.slot] = len(request.context.tokens) - 1
        with RowDraws(ready) as draws:
            drafting = [request.slot for request in ready]
            while drafting:
                out = self.runner.step(torch.tensor(current, device=device)[:, None], hidden, positions)
                drawn = draws.draw(out.logits[:, -1], drafting)
                for slot, (token, _) in drawn.items():
                    current[slot] = token
                drafting = [slot for slot in drafting if drawn[slot][1]]
                hidden = out.hidden
            return draws.proposals(requests, device)

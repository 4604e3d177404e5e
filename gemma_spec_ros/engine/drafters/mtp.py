"""The Gemma 4 MTP assistant: drafts from the target's last hidden state and shared K/V."""

import torch

from .. import models
from .base import DraftContext, Drafter, LoadContext, Proposal, draw, grammar_lookahead, stack


class MtpDrafter(Drafter):
    """
    Gemma4AssistantForCausalLM drafting from the target's last hidden state and shared K/V.

    Every draft step feeds [target embedding of the last token, hidden state] at the same position; the K/V of
    rejected drafts is cut from what the assistant sees. It drafts all K: measured on the bundled models, its
    acceptance stays high where its confidence is low.
    """

    name = 'mtp'
    needs_target_states = True

    def __init__(self, assistant, target_embeddings):
        self._assistant = assistant
        self._embed = target_embeddings
        self._hidden = None      # [1, 1, hidden] target state that predicted the last token
        self._shared_kv = None   # {layer_type: (keys, values)} up to the token before the last one

    @classmethod
    def load(cls, context: LoadContext) -> 'MtpDrafter':
        path = context.config.assistant_path
        context.progress('loading MTP assistant {}'.format(path))
        assistant = models.load_assistant(path, context.device, context.dtype)
        models.check_same_vocab(context.target, context.tokenizer, assistant, path, 'MTP assistant')
        models.check_assistant_fits(context.target, assistant, path)
        return cls(assistant, context.target.get_input_embeddings())

    def start(self, prompt_ids: list[int]) -> None:
        self._hidden = None
        self._shared_kv = None

    def observe(self, target_out, num_fed: int, num_kept: int) -> None:
        if target_out.shared_kv_states is None:  # a pass without states (speculation paused): wait for the next
            self._hidden = self._shared_kv = None
            return
        self._hidden = target_out.hidden_states[-1][:, num_kept - 1:num_kept]
        drop = num_fed - num_kept
        kv = target_out.shared_kv_states
        if drop:
            kv = {kind: (keys[..., :-drop, :], values[..., :-drop, :]) for kind, (keys, values) in kv.items()}
        self._shared_kv = kv

    def propose(self, context: DraftContext, k: int) -> Proposal | None:
        if self._hidden is None:
            return None
        device = self._hidden.device
        position = torch.tensor([[len(context.tokens) - 1]], device=device)
        token = context.last_token
        hidden = self._hidden
        drafted, probs = [], []
        with grammar_lookahead(context) as look:
            for _ in range(k):
                inputs = torch.cat([self._embed(token.unsqueeze(0)), hidden], dim=-1)  # [1, 1, 2 * hidden]
                out = self._assistant(inputs_embeds=inputs, position_ids=position, shared_kv_states=self._shared_kv)
                token, draft_probs, more = draw(out.logits[:, -1], context, look=look)  # stops only at a stop token
                hidden = out.last_hidden_state
                drafted.append(token)
                probs.append(draft_probs)
                if not more:
                    break
        return stack(drafted, probs)

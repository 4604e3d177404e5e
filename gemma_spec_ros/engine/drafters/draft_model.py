"""A smaller same-family Gemma 4 model drafting with its own KV cache."""

import torch

from ..runtime import causal_lm, models
from .base import DraftContext, Drafter, DraftRound, LoadContext, Proposal, grammar_lookahead


class DraftModelDrafter(Drafter):
    """A smaller Gemma4ForCausalLM with its own KV cache, rolled back to the accepted prefix after each round."""

    name = 'draft'

    def __init__(self, draft_lm):
        self._lm = draft_lm  # causal_lm.FastCausalLM or DynamicCausalLM, as engine.compile says
        self.weights_bytes = causal_lm.parameter_bytes(draft_lm.model)
        self.kv_cache_bytes = draft_lm.nbytes
        self._proposed = 0  # drafts proposed in the round being verified

    @classmethod
    def load(cls, context: LoadContext) -> 'DraftModelDrafter':
        path = context.config.draft_model_path
        context.progress('loading draft model {}'.format(path))
        model = models.load_causal_lm(path, 'draft model', context.device, context.dtype)
        models.check_same_vocab(context.target, context.tokenizer, model, path, 'draft model')
        # steps of up to K_max + 1 tokens: a round's rollback of up to K_max - 1 drafts must fit the sliding slack
        draft_lm = causal_lm.build_causal_lm(model, context.config.compile, context.context_limit,
                                             context.config.max_draft_tokens + 1, 'draft model', context.progress)
        return cls(draft_lm)

    def warmup(self, progress) -> int:
        return self._lm.warmup(logits_to_keep=1, progress=progress).graphs

    def graph_jobs(self) -> list:
        return self._lm.graph_jobs(self.name, logits_to_keep=1)

    def start(self, prompt_ids: list[int]) -> None:
        # prefill here, so that the first round's drafting cost is a normal step
        self._lm.reset()
        self._lm.prefill(torch.tensor([prompt_ids], device=self._lm.model.device), logits_to_keep=1)
        self._proposed = 0

    def propose(self, context: DraftContext, k: int) -> Proposal | None:
        feed = torch.tensor([context.tokens[self._lm.length:]], device=self._lm.model.device)  # [1, new] not cached
        with grammar_lookahead(context) as look:
            drafts = DraftRound(context, context.min_confidence, look)
            for _ in range(k):
                token, more = drafts.draw(self._lm.append(feed, logits_to_keep=1).logits[:, -1])  # token [1]
                if not more:
                    break
                feed = token.unsqueeze(0)  # [1, 1]
        proposal = drafts.proposal()
        self._proposed = proposal.tokens.shape[0]
        return proposal

    def observe(self, target_out, num_fed: int, num_kept: int) -> None:
        # the cache holds the last emitted token and drafts 1..k-1; keep it up to the last accepted draft
        if not self._proposed:
            return
        self._lm.crop(-max(0, (self._proposed - 1) - (num_kept - 1)))
        self._proposed = 0

"""A smaller same-family Gemma 4 model drafting with its own KV cache."""

import torch
from transformers import DynamicCache

from .. import models
from .base import DraftContext, Drafter, LoadContext, Proposal, draw, grammar_lookahead, stack


class DraftModelDrafter(Drafter):
    """A smaller Gemma4ForCausalLM with its own KV cache, rolled back to the accepted prefix after each round."""

    name = 'draft'

    def __init__(self, model):
        self._model = model
        self._cache = None
        self._cached = 0    # tokens in the draft cache
        self._proposed = 0  # drafts proposed in the round being verified

    @classmethod
    def load(cls, context: LoadContext) -> 'DraftModelDrafter':
        path = context.config.draft_model_path
        context.progress('loading draft model {}'.format(path))
        model = models.load_causal_lm(path, 'draft model', context.device, context.dtype)
        models.check_same_vocab(context.target, context.tokenizer, model, path, 'draft model')
        return cls(model)

    def start(self, prompt_ids: list[int]) -> None:
        # prefill here, so that the first round's drafting cost is a normal step
        self._cache = DynamicCache(config=self._model.config)
        self._cache.activate_past_recording()
        prompt = torch.tensor([prompt_ids], device=self._model.device)
        positions = torch.arange(len(prompt_ids), device=self._model.device).unsqueeze(0)
        self._model(input_ids=prompt, position_ids=positions, cache=self._cache, use_cache=True, logits_to_keep=1)
        self._cache.crop(0)
        self._cached = len(prompt_ids)
        self._proposed = 0

    def propose(self, context: DraftContext, k: int) -> Proposal | None:
        device = self._model.device
        tokens = context.tokens
        feed = torch.tensor([tokens[self._cached:]], device=device)  # [1, new] accepted tokens not yet cached
        position = self._cached
        drafted, probs = [], []
        with grammar_lookahead(context) as look:
            for _ in range(k):
                count = feed.shape[1]
                positions = torch.arange(position, position + count, device=device).unsqueeze(0)
                logits = self._model(input_ids=feed, position_ids=positions, cache=self._cache, use_cache=True,
                                     logits_to_keep=1, attention_mask=models.single_token_masks(feed)).logits[:, -1]
                position += count
                token, draft_probs, more = draw(logits, context, context.min_confidence, look)  # token [1]
                drafted.append(token)
                probs.append(draft_probs)
                if not more:
                    break
                feed = token.unsqueeze(0)  # [1, 1]
        self._cached = position
        self._proposed = len(drafted)
        return stack(drafted, probs)

    def observe(self, target_out, num_fed: int, num_kept: int) -> None:
        # the cache holds the last emitted token and drafts 1..k-1; keep it up to the last accepted draft
        if not self._proposed:
            return
        remove = max(0, (self._proposed - 1) - (num_kept - 1))
        self._cache.crop(-remove)
        self._cached -= remove
        self._proposed = 0

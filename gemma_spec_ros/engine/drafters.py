"""Drafters behind one small interface: start a request, propose up to k tokens, observe each target pass."""

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from .sampling import SamplingParams, logits_to_probs, sample


@dataclass
class DraftContext:
    """What a drafter may read in a round. The last token is emitted but not yet in the target's cache."""

    tokens: list[int]                  # prompt + generated token ids
    last_token: torch.Tensor           # [1] tokens[-1], already on the device
    sampling: SamplingParams
    generator: torch.Generator | None
    min_confidence: float = 0.0        # the draft model stops at a token it gives less probability (0 = never)


@dataclass
class Proposal:
    """Proposed tokens and, for sampled proposals, the distributions they were drawn from."""

    tokens: torch.Tensor              # [k] long, on the target device
    draft_probs: torch.Tensor | None  # [k, vocab] float32; None for deterministic proposals (one-hot)


class Drafter:
    """Interface; NoneDrafter is the plain decoding baseline (proposes nothing)."""

    name = 'none'
    needs_target_states = False  # True: target passes must return the last hidden state and shared K/V

    def start(self, prompt_ids: list[int]) -> None:
        """Begin a request (forget the previous one); called before the target's prefill."""

    def propose(self, context: DraftContext, k: int) -> Proposal | None:
        """Up to k tokens that continue context.tokens, or None for a plain round."""
        return None

    def observe(self, target_out, num_fed: int, num_kept: int) -> None:
        """After every target pass: num_fed tokens went in, the first num_kept of them stay in the cache."""


class NoneDrafter(Drafter):
    """Plain autoregressive decoding through the same loop."""


class NgramDrafter(Drafter):
    """
    Prompt lookup: find the latest earlier occurrence of the context's last n tokens and propose what followed.

    Example: tokens [5, 6, 7, 9, 5, 6] with n = 2 match (5, 6) at position 0, so k = 2 proposes [7, 9];
    tokens [1, 2, 1, 2] with n = 2 match (1, 2) at position 0 and k = 3 proposes [1, 2, 1] (periodic).
    Longer n-grams are tried first. An incremental index keeps the work per round independent of context length.
    """

    name = 'ngram'

    def __init__(self, ngram_min: int, ngram_max: int, device: torch.device):
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError('ngram sizes need 1 <= ngram_min <= ngram_max, got {} and {}'.format(ngram_min, ngram_max))
        self._sizes = range(ngram_max, ngram_min - 1, -1)
        self._device = device
        self._continuation: dict[tuple[int, ...], int] = {}  # n-gram -> index of the token that followed it last
        self._indexed = 0

    def start(self, prompt_ids: list[int]) -> None:
        self._continuation.clear()
        self._indexed = 0

    def propose(self, context: DraftContext, k: int) -> Proposal | None:
        tokens = context.tokens
        self._index_until(tokens, len(tokens))
        for n in self._sizes:
            if len(tokens) <= n:
                continue
            follow = self._continuation.get(tuple(tokens[-n:]))
            if follow is not None:
                return Proposal(torch.tensor(self._continue(tokens, follow, k), device=self._device), None)
        return None

    @staticmethod
    def _continue(tokens: list[int], follow: int, k: int) -> list[int]:
        # copy what followed the match; a match just behind the end repeats the pattern periodically
        draft: list[int] = []
        for index in range(follow, follow + k):
            draft.append(tokens[index] if index < len(tokens) else draft[index - len(tokens)])
        return draft

    def _index_until(self, tokens: list[int], end: int) -> None:
        # index every n-gram that ends before the last token, pointing at the token that followed it
        for follow in range(max(self._indexed, 1), end):
            for n in self._sizes:
                if follow >= n:
                    self._continuation[tuple(tokens[follow - n:follow])] = follow
        self._indexed = max(self._indexed, end)


NO_MASKS = {'full_attention': None, 'sliding_attention': None}
# with adaptive K, the draft model ends a round at a token it gives less than this probability (as transformers'
# assisted generation does), so rounds stay short where acceptance is unlikely. The MTP assistant drafts all K:
# measured on the bundled models, its acceptance stays high where its confidence is low
MIN_DRAFT_CONFIDENCE = 0.4


def single_token_masks(token_ids: torch.Tensor) -> dict | None:
    """
    Attention masks for a pass over token_ids [1, q]: none needed for one token, else built by the model.

    A single query may see every cached key: full layers hold only the past, and a rolled-back sliding layer hands
    out exactly its window. Mask construction is a noticeable share of a small model's decode step.
    """
    return NO_MASKS if token_ids.shape[1] == 1 else None


def _draw(logits: torch.Tensor, context: DraftContext,
          min_confidence: float = 0.0) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
    """
    One draft token from logits [1, vocab]: argmax when greedy (one-hot), else sampled from the processed probs.

    Also tells whether to keep drafting: the drafter's probability of its choice reaches min_confidence (checking
    it costs one host sync per draft token, so it is skipped when min_confidence is 0).
    """
    if context.sampling.greedy:
        token, draft_probs = logits.argmax(dim=-1), None
        top = torch.softmax(logits.float(), dim=-1).max() if min_confidence else None
    else:
        draft_probs = logits_to_probs(logits, context.sampling)  # [1, vocab]
        token = sample(draft_probs, context.generator)
        top = draft_probs.max() if min_confidence else None
    return token, draft_probs, top is None or top.item() >= min_confidence


def _stack(tokens: list[torch.Tensor], probs: list[torch.Tensor | None]) -> Proposal:
    draft_probs = None if probs[0] is None else torch.cat(probs)  # [k, vocab]
    return Proposal(torch.cat(tokens), draft_probs)


class DraftModelDrafter(Drafter):
    """A smaller Gemma4ForCausalLM with its own KV cache, rolled back to the accepted prefix after each round."""

    name = 'draft'

    def __init__(self, model):
        self._model = model
        self._cache = None
        self._cached = 0    # tokens in the draft cache
        self._proposed = 0  # drafts proposed in the round being verified

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
        for _ in range(k):
            count = feed.shape[1]
            positions = torch.arange(position, position + count, device=device).unsqueeze(0)
            logits = self._model(input_ids=feed, position_ids=positions, cache=self._cache, use_cache=True,
                                 logits_to_keep=1, attention_mask=single_token_masks(feed)).logits[:, -1]  # [1, vocab]
            position += count
            token, draft_probs, confident = _draw(logits, context, context.min_confidence)
            drafted.append(token)
            probs.append(draft_probs)
            if not confident:
                break
            feed = token.unsqueeze(0)  # [1, 1]
        self._cached = position
        self._proposed = len(drafted)
        return _stack(drafted, probs)

    def observe(self, target_out, num_fed: int, num_kept: int) -> None:
        # the cache holds the last emitted token and drafts 1..k-1; keep it up to the last accepted draft
        if not self._proposed:
            return
        remove = max(0, (self._proposed - 1) - (num_kept - 1))
        self._cache.crop(-remove)
        self._cached -= remove
        self._proposed = 0


class MtpDrafter(Drafter):
    """
    Gemma4AssistantForCausalLM drafting from the target's last hidden state and shared K/V.

    Every draft step feeds [target embedding of the last token, hidden state] at the same position; the K/V of
    rejected drafts is cut from what the assistant sees.
    """

    name = 'mtp'
    needs_target_states = True

    def __init__(self, assistant, target_embeddings):
        self._assistant = assistant
        self._embed = target_embeddings
        self._hidden = None      # [1, 1, hidden] target state that predicted the last token
        self._shared_kv = None   # {layer_type: (keys, values)} up to the token before the last one

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
        for _ in range(k):
            inputs = torch.cat([self._embed(token.unsqueeze(0)), hidden], dim=-1)  # [1, 1, 2 * hidden]
            out = self._assistant(inputs_embeds=inputs, position_ids=position, shared_kv_states=self._shared_kv)
            token, draft_probs, _ = _draw(out.logits[:, -1], context)
            hidden = out.last_hidden_state
            drafted.append(token)
            probs.append(draft_probs)
        return _stack(drafted, probs)

"""A smaller same-family Gemma 4 model drafting with its own KV cache."""

import torch

from ..runtime import FastCausalLM
from ..runtime.model import checkpoints
from ..runtime.quant.quantize import Quantizer
from ..runtime.steps import causal_lm
from ..runtime.steps.rows import FastRows, row_bucket
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

CATCH_UP_AFTER = 2  # a goal's slot lacks one or two tokens after a round of its own; more are fed apart, eager


class DraftModelDrafter(Drafter):
    """
    A smaller Gemma4ForCausalLM with its own KV cache, rolled back to the accepted prefix after each round.

    It reads the text: in its prompt the target's image placeholders (placeholders: image, video and audio token ids,
    whose positions hold the vision tower's embeddings in the target) are pad, which keeps its positions the target's.
    """

    name = 'draft'

    def __init__(self, draft_lm, placeholders: frozenset[int] = frozenset()):
        self._lm = draft_lm  # causal_lm.FastCausalLM or DynamicCausalLM, as engine.compile says
        self._placeholders = placeholders
        self.weights_bytes = causal_lm.weights_bytes(draft_lm)
        self.kv_cache_bytes = draft_lm.nbytes
        self._proposed = 0  # drafts proposed in the round being verified
        self._batch_rows: DraftModelRows | None = None  # drafting for a batch's goals (join_batch)
        self._prefix = None  # runtime.PrefixCache of the draft model (keep_prefixes)

    @classmethod
    def load(cls, context: LoadContext) -> 'DraftModelDrafter':
        path = context.config.draft_model_path
        context.progress('loading draft model {}'.format(path))
        quantizer = Quantizer.for_mode(context.config.quantization)
        model = checkpoints.load_causal_lm(path, 'draft model', context.device, context.dtype, quantizer)
        checkpoints.check_same_vocab(context.target, context.tokenizer, model, path, 'draft model')
        # steps of up to K_max + 1 tokens: a round's rollback of up to K_max - 1 drafts must fit the sliding slack
        draft_lm = causal_lm.build_causal_lm(model, context.config.compile, context.context_limit,
                                             context.config.max_draft_tokens + 1, 'draft model', context.progress,
                                             quantizer, context.config.row_product_max_rows)
        return cls(draft_lm, checkpoints.placeholder_ids(context.target))

    def warmup(self, progress) -> int:
        batched = 0 if self._batch_rows is None else self._batch_rows.runner.warmup(progress)
        return self._lm.warmup(logits_to_keep=1, progress=progress).graphs + batched

    def join_batch(self, target_rows) -> list | None:
        if not isinstance(self._lm, FastCausalLM):  # transformers' forward: no batched steps
            return None
        runner = FastRows(self._lm.lean, self._lm.mode, target_rows.cache.num_slots, target_rows.cache.context_limit,
                          self._lm.max_query)
        self._batch_rows = DraftModelRows(runner)
        self._batch_rows.prefix = self._prefix
        self.kv_cache_bytes += runner.nbytes
        return runner.graph_jobs('draft batch')

    def for_batch(self, slot: int) -> 'DraftModelGoalDrafter':
        return DraftModelGoalDrafter(self._batch_rows, slot)

    def graph_jobs(self) -> list:
        return self._lm.graph_jobs(self.name, logits_to_keep=1)

    @property
    def prompt_kv_bytes_per_token(self) -> float:
        if not isinstance(self._lm, FastCausalLM):
            return 0.0
        return self._lm.cache.nbytes / self._lm.cache.context_limit

    def keep_prefixes(self, prefix_cache) -> None:
        self._prefix = prefix_cache
        if self._batch_rows is not None:
            self._batch_rows.prefix = prefix_cache

    def start(self, prompt_ids: list[int]) -> None:
        # prefill here, so that the first round's drafting cost is a normal step; the target's image placeholders
        # are pad, whatever the images are: the draft model's K/V does not depend on them
        if self._placeholders:
            pad = checkpoints.text_config(self._lm.model).pad_token_id
            prompt_ids = [pad if token in self._placeholders else token for token in prompt_ids]
        self._lm.prefill_prompt(torch.tensor([prompt_ids], device=self._lm.model.device), self._prefix,
                                logits_to_keep=1)
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


class DraftModelGoalDrafter(Drafter):
    """One goal's draft-model drafting in a batch: its slot of the draft model's slotted cache."""

    name = 'draft'

    def __init__(self, rows: 'DraftModelRows', slot: int):
        self.rows = rows
        self.slot = slot
        self.proposed = 0  # drafts proposed in the round being verified

    @property
    def cache(self):
        """The goal's slot of the draft model's cache (a runtime.KvSlot)."""
        return self.rows.runner.cache.slots[self.slot]

    def start(self, prompt_ids: list[int]) -> None:
        self.rows.runner.prefill_prompt(self.slot, torch.tensor([prompt_ids], device=self.rows.runner.lean.device),
                                        self.rows.prefix)
        self.proposed = 0

    def propose(self, context: DraftContext, k: int) -> Proposal | None:
        return self.rows.propose_rows([RowRequest(self.slot, context, k, self)],
                                      row_bucket(self.slot + 1, self.rows.runner.cache.num_slots))[0]

    def observe(self, target_out, num_fed: int, num_kept: int) -> None:
        # as DraftModelDrafter.observe: the slot holds the last emitted token and drafts 1..k-1
        if self.proposed:
            self.cache.crop(-max(0, (self.proposed - 1) - (num_kept - 1)))
            self.proposed = 0


class DraftModelRows(DraftRows):
    """
    Draft-model drafting for a batch: each step runs the draft model for every row at once (runtime.FastRows).

    The first step of a round feeds each row what its slot lacks (one or two tokens, padded to the longest; a slot
    further behind catches up first, on its own), the others one draft each; each goal draws as on its own
    (DraftRound), greedy rows without a grammar from one argmax.
    """

    def __init__(self, runner: FastRows):
        self.runner = runner
        self.prefix = None  # the draft model's runtime.PrefixCache, shared with the single-goal drafter

    def propose_rows(self, requests: list[RowRequest], batch: int) -> list[Proposal | None]:
        runner, device = self.runner, self.runner.lean.device
        caches = {request.slot: request.drafter.cache for request in requests}
        feeds = {request.slot: request.context.tokens[caches[request.slot].length:] for request in requests}
        for slot, feed in feeds.items():  # behind by more than a round (other drafters' rounds, plain ones): catch up
            if len(feed) > CATCH_UP_AFTER:
                runner.extend(slot, torch.tensor([feed[:-1]], device=device))
                feeds[slot] = feed[-1:]
        with RowDraws(requests) as draws:
            drafting = [request.slot for request in requests]
            while drafting:
                width = max(len(feeds[slot]) for slot in drafting)
                token_rows, starts = [[0] * width for _ in range(batch)], [0] * batch
                last = [0] * batch  # each row's last fed position: its logits predict the next draft
                for slot in drafting:
                    token_rows[slot] = feeds[slot] + [0] * (width - len(feeds[slot]))
                    starts[slot], last[slot] = caches[slot].length, len(feeds[slot]) - 1
                out = runner.step(torch.tensor(token_rows, device=device), starts)
                drawn = draws.draw(out.logits[torch.arange(batch, device=device), torch.tensor(last, device=device)],
                                   drafting)
                for slot in drafting:
                    caches[slot].advance(starts[slot], width)
                    caches[slot].crop(-(width - len(feeds[slot])))  # a padded row keeps what it fed
                    feeds[slot] = [drawn[slot][0]]
                drafting = [slot for slot in drafting if drawn[slot][1]]
            for request in requests:
                request.drafter.proposed = draws.count(request.slot)
            return draws.proposals(requests, device)

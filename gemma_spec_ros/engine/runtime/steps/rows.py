"""
Batched steps for continuous batching: the target's (FastRows) and the MTP assistant's (AssistantRows).

FastRows runs B rows of Q tokens, row b in KV-cache slot b; AssistantRows one draft step per row, reading slot b.

A round of several goals is one pass: each goal's last token and drafts fill a row, padded to the longest row, over
a SlottedKvCache with one slot per goal. The products read the weights once for every row, which is what batching
buys where decoding is bound by memory bandwidth. The step tables (steps._Steps) are the causal LM's: eager, compiled
per (rows, query variant) on CPU, captured per (rows, q, key-length bucket) on CUDA, and built by a background
warm-up on a shadow (runner._Shadowed) like the single-goal steps.

Rows come in buckets (row_bucket): a batch of 3 goals runs the 4-row step with an idle row, so that few graphs serve
every batch.
"""

import functools
import time
from collections.abc import Sequence

import torch

from ..model.cache import SlottedKvCache
from ..model.forward import LeanGemma4, StepOutput
from ..model.prefix_cache import ImageKey, PrefixCache
from ..model.vision import SoftTokens
from .assistant import FastAssistant
from .runner import GraphJob, _Shadowed, _stage_shadow_graphs
from .tables import _Steps, query_variant_ends


def row_buckets(max_rows: int) -> list[int]:
    """
    Row counts batched steps are built for: powers of two from 1 below max_rows, then max_rows.

    A goal alone in slot 0 runs the 1-row step: an idle row would cost it a fifth of its step and more.
    """
    sizes, size = [], 1
    while size < max_rows:
        sizes.append(size)
        size *= 2
    return sizes + [max_rows]


def row_bucket(rows: int, max_rows: int) -> int:
    """Return the smallest bucket that holds rows."""
    return next(size for size in row_buckets(max_rows) if size >= rows)


def slot_nbytes(lean: LeanGemma4, context_limit: int, max_query: int) -> int:
    """Bytes of one batch slot of lean's KV cache at context_limit: a one-slot cache's (its shared part included)."""
    return lean.new_slotted_cache(1, context_limit, max_query).slot_nbytes


class FastRows(_Shadowed):
    """
    Batched steps of a target over a cache of num_slots slots (one per running goal); not thread-safe.

    The target's lean model (and so its weights) is shared with the single-goal runner (runner.FastCausalLM).
    """

    def __init__(self, lean: LeanGemma4, mode: str, num_slots: int, context_limit: int, max_query: int):
        self.lean = lean
        self.mode = mode
        self.max_query = max_query
        self.cache: SlottedKvCache = lean.new_slotted_cache(num_slots, context_limit, max_query)
        self._steps = self._new_steps()

    def _new_steps(self) -> dict[int, _Steps]:
        """
        Make a step table per row bucket.

        A step's products run over rows x q token rows: a table's static query variants (steps.query_variant) are
        the q whose products are multiply-reduces (layers._linear), and always q = 1 (the dynamic variant starts at
        2: torch specialises a dimension of size 1).
        """
        rows_max = self.lean.row_product_max_rows
        return {rows: _Steps(self.mode, self.lean.device, self.cache.capacity, self.lean.inlines_layers,
                             max(1, rows_max // rows)) for rows in row_buckets(self.cache.num_slots)}

    @property
    def nbytes(self) -> int:
        """Bytes of the slotted KV cache."""
        return self.cache.nbytes

    @torch.inference_mode()
    def prefill(self, slot: int, input_ids: torch.Tensor) -> StepOutput:
        """Put a goal's prompt input_ids [1, n] into a freshly reset slot (eager); the last position's logits."""
        cache = self.cache.slots[slot]
        cache.reset()
        return self.lean.prefill(input_ids, cache, 0, 1)

    @torch.inference_mode()
    def prefill_prompt(self, slot: int, input_ids: torch.Tensor, prefix_cache: PrefixCache | None = None,
                       soft: SoftTokens | None = None,
                       image_keys: Sequence[ImageKey] | None = None) -> tuple[StepOutput, int]:
        """
        Put a goal's prompt input_ids [1, n] into a slot; return the last position's output and the tokens reused.

        With a prefix_cache (the target's): through it, as FastCausalLM.prefill_prompt. Without: as prefill.
        """
        cache = self.cache.slots[slot]
        if prefix_cache is None:
            cache.reset()
            return self.lean.prefill(input_ids, cache, 0, 1, soft), 0
        return prefix_cache.prefill(self.lean, cache, input_ids, 1, soft, image_keys)

    @torch.inference_mode()
    def extend(self, slot: int, input_ids: torch.Tensor) -> StepOutput:
        """Append input_ids [1, n] (any n) at a slot's end, eager: a goal's tokens its slot has not seen."""
        cache = self.cache.slots[slot]
        return self.lean.prefill(input_ids, cache, cache.length, 1)

    @torch.inference_mode()
    def step(self, input_ids: torch.Tensor, starts: list[int]) -> StepOutput:
        """
        Run rows input_ids [B, Q] (B a row bucket), row b at positions starts[b].. in slot b; logits [B, Q, vocab].

        The caller records in each slot what stays (``cache.slots[b].advance`` and ``crop``): a padded row writes
        past its own tokens, and those positions are provisional like rejected drafts.
        """
        rows, width = input_ids.shape
        if not 1 <= width <= self.max_query:
            raise ValueError('a batched step takes rows of 1..{} tokens (max_query), got {}'.format(self.max_query,
                                                                                                 width))
        positions = torch.tensor(starts, device=self.lean.device)[:, None] + torch.arange(width,
                                                                                         device=self.lean.device)
        kv_positions = self.cache.key_positions[:self._steps[rows].key_length(max(starts) + width)]
        logits, hidden = self._steps[rows].run(('rows', rows), lambda: self._step_function(),
                                                (input_ids, positions), kv_positions, dynamic_dims=(1, 1))
        return StepOutput(logits, hidden)

    def _step_function(self):
        lean, cache = self.lean, self.cache

        def step(input_ids, positions, kv_positions):
            out = lean.step_rows(input_ids, positions, cache, kv_positions.shape[0], input_ids.shape[1])
            return out.logits, out.hidden
        return step

    def graph_jobs(self, role: str) -> list[GraphJob]:
        """List the batched step graphs a background warm-up builds: per row bucket, per query variant (its ends)."""
        jobs = []
        for rows, table in self._steps.items():
            if not table.dynamic:
                continue
            for ends in query_variant_ends(self.max_query, table.row_product_max_rows):
                name = '{} rows={} q={}'.format(role, rows, '..'.join(str(q) for q in ends))
                keys = tuple(table.variant_key(('rows', rows), q, 0) for q in ends)
                jobs.append(GraphJob(name, self, table, keys, functools.partial(self._build_on_shadow, rows, ends)))
        return jobs

    @torch.inference_mode()
    def warmup(self, progress) -> int:
        """Compile or capture every batched step before the first goal (blocking warm-up); returns the graphs."""
        started = time.perf_counter()
        for rows, table in self._steps.items():
            queries = range(1, self.max_query + 1)
            if table.dynamic:  # each variant at both ends, as the single-goal steps
                queries = sorted({q for ends in query_variant_ends(self.max_query, table.row_product_max_rows)
                                  for q in ends})
            for q in queries:
                for length in table.key_lengths():
                    self.step(torch.zeros((rows, q), dtype=torch.long, device=self.lean.device),
                              [max(0, length - q - 1)] * rows)
            progress('warm-up: batched steps of {} rows done ({} mode, {:.1f} s)'.format(
                rows, self.mode, time.perf_counter() - started))
        for slot in self.cache.slots:
            slot.reset()
        return sum(table.count for table in self._steps.values())

    @torch.inference_mode()
    def _build_on_shadow(self, rows: int, queries: tuple[int, ...]) -> int:
        shadow = self.shadow()
        for q in queries:
            shadow.step(torch.zeros((rows, q), dtype=torch.long, device=self.lean.device), [0] * rows)
        return _stage_shadow_graphs(self._steps[rows], shadow._steps[rows], self.cache, shadow.cache)

    def _give_shadow_a_cache(self, shadow: 'FastRows') -> None:
        shadow.cache = self.lean.new_slotted_cache(self.cache.num_slots, self.cache.context_limit, self.max_query)


class AssistantRows(_Shadowed):
    """
    The MTP assistant's draft steps for every row of a batch at once.

    Row b drafts from slot b of the target's slotted cache (FastRows.cache), which it only reads. One table per row
    bucket, as FastRows.
    """

    def __init__(self, assistant: FastAssistant, target_rows: FastRows):
        self.lean = assistant.lean
        self.mode = target_rows.mode
        self.cache = target_rows.cache
        self._target_rows = target_rows
        self._steps = self._new_steps()

    def _new_steps(self) -> dict[int, _Steps]:
        return {rows: _Steps(self.mode, self.lean.target.device, self.cache.capacity, self.lean.inlines_layers)
                for rows in row_buckets(self.cache.num_slots)}

    @torch.inference_mode()
    def step(self, token_ids: torch.Tensor, hidden: torch.Tensor, positions: list[int]) -> StepOutput:
        """
        Run one draft step per row.

        token_ids [B, 1] and hidden [B, 1, backbone] at positions[b] (the target length of slot b, the position of
        the row's last token) -> logits [B, 1, vocab], hidden [B, 1, backbone].
        """
        rows = token_ids.shape[0]
        table = self._steps[rows]
        position_tensor = torch.tensor(positions, device=self.lean.target.device)[:, None]
        kv_positions = self.cache.key_positions[:table.key_length(max(positions))]
        logits, projected = table.run(('mtp rows', rows), self._step_function, (token_ids, hidden, position_tensor),
                                      kv_positions, dynamic_dims=(None, None, None))
        return StepOutput(logits, projected)

    def _step_function(self):
        lean, cache = self.lean, self.cache

        def step(token_ids, hidden, positions, kv_positions):
            out = lean.step_rows(token_ids, hidden, positions, cache, kv_positions.shape[0])
            return out.logits, out.hidden
        return step

    def blank_inputs(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids [rows, 1] and hidden [rows, 1, backbone] of zeros, to fill with each row's."""
        device = self.lean.target.device
        return (torch.zeros((rows, 1), dtype=torch.long, device=device),
                torch.zeros((rows, 1, self.lean.target.hidden_size), dtype=self.lean.target.dtype, device=device))

    @torch.inference_mode()
    def warmup(self, progress) -> int:
        """Compile or capture every row bucket's step before the first goal (blocking warm-up); returns the graphs."""
        started = time.perf_counter()
        for rows, table in self._steps.items():
            for length in table.key_lengths():
                self.step(*self.blank_inputs(rows), [max(1, length)] * rows)
            progress('warm-up: batched MTP steps of {} rows done ({} mode, {:.1f} s)'.format(
                rows, self.mode, time.perf_counter() - started))
        return sum(table.count for table in self._steps.values())

    def graph_jobs(self, role: str) -> list[GraphJob]:
        """List the graphs a background warm-up builds: one per row bucket (none unless compiled on CPU)."""
        return [GraphJob('{} rows={}'.format(role, rows), self, table, (table.variant_key(('mtp rows', rows), 1, 0),),
                         functools.partial(self._build_on_shadow, rows))
                for rows, table in self._steps.items() if table.dynamic]

    @torch.inference_mode()
    def _build_on_shadow(self, rows: int) -> int:
        shadow = self.shadow()
        shadow.step(*self.blank_inputs(rows), [1] * rows)
        return _stage_shadow_graphs(self._steps[rows], shadow._steps[rows], self.cache, shadow.cache)

    def _give_shadow_a_cache(self, shadow: 'AssistantRows') -> None:
        target = self._target_rows
        shadow.cache = target.lean.new_slotted_cache(self.cache.num_slots, self.cache.context_limit, target.max_query)

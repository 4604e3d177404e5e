"""
The EAGLE-3 head's runner (FastEagle3): its entries as step functions per entry count over its static K/V.

A round enters its true entries (the accepted tokens: 1..K+1, the target's states fused in the step) and then one
drafted entry per draft, each a step of the head's one layer. Compiled, a step is one graph (inductor on CPU, with
the head's products as row products, or captured on CUDA); entries beyond max_query (a prompt's) run eager.
"""

import functools
import time

import torch

from ..model.eagle import Eagle3Cache, Eagle3Head, enter_entries
from ..model.weights import store_exact_half
from .runner import FastCausalLM, GraphJob, Progress, WarmupReport, _Shadowed, _stage_shadow_graphs
from .tables import INDUCTOR_MODES, _Steps, query_variant_ends


class FastEagle3(_Shadowed):
    """
    Eagle3Head entries through per-q step functions in the target's compile mode, on an Eagle3Cache.

    Compiled for CPU, the head's matrices are stored in 16 bits where that is exact (weights.store_exact_half, as for
    the MTP assistant): a drafting step is memory-bound, and its row products convert each weight as they read it.
    """

    def __init__(self, head: Eagle3Head, target: FastCausalLM, capacity: int, max_query: int):
        self.head = head
        self.mode = target.mode
        self.device, self.dtype = target.lean.device, target.lean.dtype
        compiled_for_cpu = self.mode in INDUCTOR_MODES and self.device.type == 'cpu'
        self.weights_dtype = store_exact_half(head) if compiled_for_cpu else None
        head.row_product_max_rows = target.row_product_max_rows
        self.cache = Eagle3Cache(head, capacity, self.device, self.dtype)
        self.max_query = max_query
        self._slots = torch.arange(capacity, device=self.device)  # kv_slots are its prefixes
        self._steps = self._new_steps()

    def _new_steps(self) -> _Steps:
        return _Steps(self.mode, self.device, self.cache.capacity, True, self.head.row_product_max_rows)

    @torch.inference_mode()
    def enter(self, embeds: torch.Tensor, features: torch.Tensor, drafted: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """
        Enter embeds [1, q, target_hidden]; return the last output [1, 1, hidden] and its logits [1, vocab].

        True entries take the target's states [1, q, 3 * target_hidden] (fused in the step), a drafted entry (q = 1)
        the head's last output [1, 1, hidden]. The output is a fresh tensor: as the next step's feature, a slice of a
        longer output would have other strides than a graph was compiled for (a recompile).
        """
        count = embeds.shape[1]
        cache = self.cache
        positions, slots = cache.inputs(count, self.device)
        kv_slots = self._slots[:self._steps.key_length(cache.length + count)]
        if count > self.max_query or kv_slots.shape[0] > cache.capacity:  # a prompt's entries: eager
            hidden, logits = self._step_function(drafted)()(embeds, features, positions, slots,
                                                            self._slots[:cache.length + count])
        else:
            hidden, logits = self._steps.run(('drafted' if drafted else 'true',),
                                             self._step_function(drafted),
                                             (embeds, features, positions, slots), kv_slots, dynamic_dims=(1, 1, 0, 0))
        cache.length += count
        return hidden[:, -1:].clone(memory_format=torch.contiguous_format), logits

    def _step_function(self, drafted: bool):
        head, cache = self.head, self.cache

        def make():
            def step(embeds, features, positions, slots, kv_slots):
                fused = features if drafted else head.fuse_target(features)
                return enter_entries(head, cache.keys, cache.values, embeds, fused, positions, slots, kv_slots)
            return step
        return make

    def _run_once(self, count: int, drafted: bool) -> None:
        """Enter count blank entries from an empty cache (a warm-up's call; the cache is reset after)."""
        config = self.head.config
        width = config.hidden_size if drafted else 3 * config.target_hidden_size
        self.cache.reset(1)
        self.enter(torch.zeros((1, count, config.target_hidden_size), dtype=self.dtype, device=self.device),
                   torch.zeros((1, count, width), dtype=self.dtype, device=self.device), drafted)
        self.cache.reset(0)

    def _variants(self) -> list[tuple[bool, tuple[int, ...]]]:
        """(drafted, entry counts that build it) of each step variant: the drafted entry, then the true ones."""
        return [(True, (1,))] + [(False, ends) for ends in query_variant_ends(self.max_query,
                                                                             self.head.row_product_max_rows)]

    @torch.inference_mode()
    def warmup(self, progress: Progress | None = None) -> WarmupReport:
        """Create the step variants: a drafted entry, and 1..max_query true entries."""
        started = time.perf_counter()
        if self.mode != 'eager':
            for drafted, ends in self._variants():
                for count in ends:
                    self._run_once(count, drafted)
        seconds = time.perf_counter() - started
        if progress is not None:
            progress('warm-up: EAGLE-3 head ({} mode, {:.1f} s)'.format(self.mode, seconds))
        return WarmupReport(self.mode, self._steps.count, seconds, self._steps.direct_count)

    def graph_jobs(self, role: str) -> list[GraphJob]:
        """List the step graphs a background warm-up builds (none unless steps compile on CPU)."""
        if not self._steps.dynamic:
            return []
        return [GraphJob('{} {} q={}'.format(role, 'drafted' if drafted else 'true', ends[0]), self, self._steps,
                         (self._steps.variant_key(('drafted' if drafted else 'true',), ends[0], 0),),
                         functools.partial(self._build_on_shadow, drafted, ends))
                for drafted, ends in self._variants()]

    @torch.inference_mode()
    def _build_on_shadow(self, drafted: bool, ends: tuple[int, ...]) -> int:
        """Compile the variant serving ends' entry counts on the shadow; stage it here."""
        shadow = self.shadow()
        for count in ends:
            shadow._run_once(count, drafted)
        return _stage_shadow_graphs(self._steps, shadow._steps, self.cache, shadow.cache)

    def _give_shadow_a_cache(self, shadow: 'FastEagle3') -> None:
        shadow.cache = Eagle3Cache(self.head, self.cache.capacity, self.device, self.dtype)

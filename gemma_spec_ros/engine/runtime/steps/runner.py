"""
Step functions per query length over the lean forward and the static cache: eager, inductor-compiled or captured.

- ``eager``: the lean forward runs eager on the static cache.
- ``inductor``: torch.compile graphs. On CPU one per step function and query variant (query_variant: each q whose
  products are multiply-reduces, with the query length static; then one for longer passes, whose products are
  aten's, with the query length dynamic), with the full-attention key length dynamic, so they serve every
  position; for models of up to model.INLINE_MAX_LAYERS layers their wrappers are C++ (cpp_wrapper); once
  compiled, a CPU graph is called without dynamo's entry (direct_graph._DirectGraph). On CUDA one per (q,
  key-length bucket), captured as CUDA graphs by inductor (mode reduce-overhead).
- ``inductor-gemm`` (CPU only): inductor, with the target's and draft model's passes of 2 tokens or more compiled on
  frozen weights, so that their products run inductor's C++ GEMM template (register-blocked, on weights packed at
  compile time) instead of multiply-reduces or aten's product. Verify passes of 3-9 tokens took 17-24 % less time
  (bench/RESULTS.md); the price is one more copy of those models' weights, and a compile at every start that no
  cache keeps (packed weights cannot be pickled): about a minute for the bundled target.
- ``cudagraph`` (CUDA only): the eager lean forward captured as a torch.cuda.CUDAGraph per (q, logits kept,
  key-length bucket), replayed on static input buffers.
- ``auto``: cudagraph on CUDA, CPU_AUTO_MODE on CPU (inductor: faster than eager on every step measured, README
  "Measured figures"). Warm-up of target + draft + assistant takes minutes with a cold inductor cache, ~25 s
  warm: torch's FX-graph and AOTAutograd caches persist across processes and reboots in TORCHINDUCTOR_CACHE_DIR
  (compile_cache_dir).

Warm up after every model is loaded and the thread count is set: compiled graphs guard on torch's thread count and
on the registered pytree types, and a change recompiles (slowly, but correctly).

This module holds the causal LM's runner (FastCausalLM) and what both runners share (warm-up reports, graph jobs,
shadows); assistant.py the MTP assistant's (FastAssistant), steps.py the step tables
(_Steps) and compile modes, direct_graph.py the CPU graphs called without dynamo, compile_cache.py inductor's cache,
torch_internals.py every use of torch's private APIs.
"""

import copy
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ...logits.verify import verify
from ..model.cache import StaticKvCache
from ..model.forward import LeanGemma4, StepOutput
from ..model.layers import ROW_PRODUCT_MAX_ROWS
from ..model.prefix_cache import ImageKey, PrefixCache
from ..model.vision import SoftTokens
from ..ops.compile_cache import release_compile_garbage
from ..ops.torch_internals import mark_static_address
from ..quant.quantize import Quantizer
from .tables import _Steps, query_variant_ends, resolve_compile_mode, stores_blocked

Progress = Callable[[str], None]


@dataclass
class WarmupReport:
    """What warm-up did."""

    mode: str
    graphs: int
    seconds: float
    direct_graphs: int = 0  # of those, variants with a graph called without dynamo's entry (direct_graph.py)


@dataclass(eq=False)  # a job is itself: the warm-up keeps sets of them
class GraphJob:
    """
    One step graph that a background warm-up builds (warmup.py), while its model serves on eager steps.

    build() compiles the variant on a shadow of the model (the same weights, a scratch cache: the served cache is
    never touched) and stages the graph on the served steps, which adopt it between rounds (Warmup.adopt).
    """

    name: str                        # e.g. 'target q=1', 'mtp greedy x4'
    owner: object                    # the FastCausalLM or FastAssistant it serves (release_shadow when done)
    steps: '_Steps'                  # the served steps: demand for this graph is counted there
    variant_keys: tuple[tuple, ...]  # the variants the graph serves
    build: Callable[[], int]         # returns how many graphs it staged

    @property
    def demand(self) -> int:
        """Steps run eager so far for want of this graph."""
        return sum(self.steps.demand[key] for key in self.variant_keys)


def _stage_shadow_graphs(served: _Steps, shadow: _Steps, served_cache: StaticKvCache,
                         shadow_cache: StaticKvCache) -> int:
    """Stage on the served steps the graphs a shadow confirmed, reading the served cache; returns how many."""
    tensors = {id(mine): theirs for mine, theirs in zip(shadow_cache.tensors(), served_cache.tensors(), strict=True)}
    graphs = {key: [record.rebound(tensors) for record in records]
              for key, records in shadow.take_confirmed().items()}
    if graphs:
        served.stage(graphs)
    return sum(len(records) for records in graphs.values())


class _Shadowed:
    """
    A runner that a background warm-up compiles on a shadow of (GraphJob.build), made on first use.

    The shadow shares the weights and has a cache and steps of its own: compiling runs a step, which must not touch
    the cache that serves.
    """

    _shadow = None
    _steps: _Steps

    def _new_steps(self) -> _Steps:
        raise NotImplementedError

    def _give_shadow_a_cache(self, shadow) -> None:
        raise NotImplementedError

    def shadow(self):
        """Return the shadow (made now if there is none)."""
        if self._shadow is None:
            shadow = copy.copy(self)
            self._give_shadow_a_cache(shadow)
            shadow._steps = shadow._new_steps()
            shadow._shadow = None
            self._shadow = shadow
        return self._shadow

    def release_shadow(self) -> None:
        """Free the shadow's cache and compiled wrappers (its graphs now serve this runner)."""
        self._shadow = None
        release_compile_garbage()


class FastCausalLM(_Shadowed):
    """
    A Gemma 4 causal LM (target or draft model) on a static cache with per-q step functions.

    Construct after the model is on its device and dtype. ``context_limit`` sizes the cache (prompt + generated),
    ``max_query`` is the longest step (K_max + 1). Not thread-safe: one request at a time.
    """

    def __init__(self, model, context_limit: int, max_query: int, compile_mode: str = 'auto',
                 quantizer: Quantizer | None = None, row_product_max_rows: int = ROW_PRODUCT_MAX_ROWS):
        self.model = model
        self.mode = resolve_compile_mode(compile_mode, model.device)
        self.row_product_max_rows = row_product_max_rows  # the engine's (an MTP assistant's steps take it too)
        # inductor-gemm: passes of 2 tokens or more keep aten's products, which the GEMM template generates
        self.lean = LeanGemma4(model, 1 if self.mode == 'inductor-gemm' else row_product_max_rows,
                               blocked=stores_blocked(self.mode, max_query, row_product_max_rows), quantizer=quantizer)
        self.quantization = None if quantizer is None else quantizer.report
        if self.mode == 'inductor-gemm':  # weights that freezing may treat as constants
            for weights in self.lean.tensors.buffers:
                mark_static_address(weights)
        self.cache: StaticKvCache = self.lean.new_cache(context_limit, max_query)
        self.max_query = max_query
        self._steps = self._new_steps()

    def _new_steps(self) -> _Steps:
        return _Steps(self.mode, self.lean.device, self.cache.context_limit, self.lean.inlines_layers,
                      self.lean.row_product_max_rows)

    @property
    def length(self) -> int:
        """Tokens in the cache."""
        return self.cache.length

    @property
    def nbytes(self) -> int:
        """Bytes this adds to the model's weights: the KV cache."""
        return self.cache.nbytes

    def reset(self) -> None:
        """Start a new request (the cache forgets every token)."""
        self.cache.reset()

    def forget_direct_graphs(self) -> None:
        """Drop the graphs recorded for direct calls: every step enters through dynamo (a benchmark's row)."""
        self._steps.forget_direct_graphs()

    def crop(self, tokens_to_remove: int) -> None:
        """Roll back: drop the last -tokens_to_remove tokens (DynamicCache.crop convention; nothing is copied)."""
        self.cache.crop(tokens_to_remove)

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor, logits_to_keep: int = 1, want_states: bool = False,
                soft: SoftTokens | None = None) -> StepOutput:
        """
        Append input_ids [1, n] (any n) eager; logits and hidden of the last logits_to_keep (0: all).

        The hidden states come free, whatever want_states says (it is there for causal_lm.DynamicCausalLM's
        interface). soft: an image goal's image embeddings (vision.py), read at their token's positions.
        """
        return self.lean.prefill(input_ids, self.cache, self.cache.length, logits_to_keep, soft)

    @torch.inference_mode()
    def prefill_prompt(self, input_ids: torch.Tensor, prefix_cache: PrefixCache | None = None, logits_to_keep: int = 1,
                       want_states: bool = False, soft: SoftTokens | None = None,
                       image_keys: Sequence[ImageKey] | None = None) -> tuple[StepOutput, int]:
        """
        Start a request with its prompt input_ids [1, n]; return prefill's output and the prompt tokens reused.

        With a prefix_cache (of this model): restore its longest cached prefix, prefill the rest in chunks and keep
        the new blocks (PrefixCache.prefill; image goals name their images in image_keys). Without: reset, prefill.
        """
        if prefix_cache is None:
            self.reset()
            return self.prefill(input_ids, logits_to_keep, want_states, soft), 0
        return prefix_cache.prefill(self.lean, self.cache, input_ids, logits_to_keep, soft, image_keys)

    def append(self, input_ids: torch.Tensor, logits_to_keep: int = 0, want_states: bool = False) -> StepOutput:
        """Append input_ids [1, n]: through the step for n when n <= max_query, else through prefill."""
        if input_ids.shape[1] <= self.max_query:
            return self.step(input_ids, logits_to_keep)
        return self.prefill(input_ids, logits_to_keep)

    @torch.inference_mode()
    def step(self, input_ids: torch.Tensor, logits_to_keep: int = 0) -> StepOutput:
        """
        Append input_ids [1, q] (q <= max_query) at the cache end through the step for q.

        logits_to_keep 0 keeps all q (the verify pass, which also returns greedy_row), 1 only the last (draft model).
        With cudagraph the outputs are copies, with inductor on CUDA they live until the next call of the same step.
        """
        q = input_ids.shape[1]
        if not 1 <= q <= self.max_query:
            raise ValueError('a step takes 1..{} tokens (max_query), got {}'.format(self.max_query, q))
        start = self.cache.length
        self.cache.check_write(start, q)
        positions = torch.arange(start, start + q, device=self.lean.device)
        kv_positions = self.cache.key_positions[:self._steps.key_length(start + q)]
        key = self._step_key(q, logits_to_keep)
        logits, hidden, *rest = self._steps.run(key, lambda: self._step_function(*key),
                                                (input_ids, positions), kv_positions, dynamic_dims=(1, 0))
        self.cache.advance(start, q)
        features = rest.pop(0) if self.lean.feature_layers else None
        return StepOutput(logits, hidden, greedy_row=rest[0] if rest else None, features=features)

    @staticmethod
    def _step_key(q: int, logits_to_keep: int) -> tuple[int, bool]:
        """(logits kept, 0: all; whether the step verifies) of a step of q tokens."""
        keep = 0 if logits_to_keep in (0, q) else logits_to_keep
        return keep, logits_to_keep == 0  # not a draft model's one-token step, which also keeps all (one) logits

    def _step_function(self, keep: int, verifying: bool):
        lean, cache = self.lean, self.cache

        def step(input_ids, positions, kv_positions):
            out = lean.step(input_ids, positions, cache, kv_positions.shape[0], keep)
            tapped = () if out.features is None else (out.features,)  # lean.feature_layers: an EAGLE-3 head reads
            if not verifying:
                return out.logits, out.hidden, *tapped
            # a verify pass: greedy verification inside the graph saves the round ~10 eager ops (README). Its drafts
            # get one more that is never accepted (-1) and the logits one more row: the same verdict, without a
            # (q - 1)-long tensor, which would make torch.compile specialise q = 2
            drafts = torch.cat([input_ids, torch.full_like(input_ids[:, :1], -1)], dim=1)[:, 1:]   # [1, q]
            if input_ids.shape[1] == 1:  # plain decoding: no draft, so verify() only takes the argmax
                num_accepted, next_token = verify(drafts[:, :0], out.logits, None, greedy=True)
            else:
                logits = torch.cat([out.logits, out.logits[:, -1:]], dim=1)                      # [1, q + 1, vocab]
                num_accepted, next_token = verify(drafts, logits, None, greedy=True)
            return out.logits, out.hidden, *tapped, torch.cat([num_accepted, drafts[0], next_token])
        return step

    @torch.inference_mode()
    def warmup(self, logits_to_keep: int = 0, progress: Progress | None = None) -> WarmupReport:
        """
        Create the step variants for q = 1..max_query before the first request; the cache is reset after.

        logits_to_keep as the steps will use it (0: all, the target's verify pass; 1: a draft model). Returns the
        mode, the number of variants created and the seconds it took.
        """
        report_progress = progress or (lambda message: None)
        started = time.perf_counter()
        queries = range(1, self.max_query + 1)
        if self._steps.dynamic:  # each variant at both ends
            queries = sorted({q for ends in query_variant_ends(self.max_query, self.lean.row_product_max_rows)
                              for q in ends})
        for q in queries:
            for length in self._steps.key_lengths():
                self.cache.reset()
                self.cache.advance(0, max(0, length - q - 1))  # the step's last position needs this key length
                self.step(torch.zeros((1, q), dtype=torch.long, device=self.lean.device), logits_to_keep)
            report_progress('warm-up: q={} done ({} mode, {:.1f} s)'.format(q, self.mode,
                                                                            time.perf_counter() - started))
        self.cache.reset()
        return WarmupReport(self.mode, self._steps.count, time.perf_counter() - started, self._steps.direct_count)

    def graph_jobs(self, role: str, logits_to_keep: int = 0) -> list[GraphJob]:
        """
        List the step graphs a background warm-up builds, a job per CPU query variant (none unless compiled on CPU).

        Each compiles at both ends of its query range, as warmup() does; logits_to_keep as the steps will use it.
        """
        if not self._steps.dynamic:
            return []
        jobs = []
        for ends in query_variant_ends(self.max_query, self.lean.row_product_max_rows):
            name = '{} q={}'.format(role, '..'.join(str(q) for q in ends))
            keys = tuple(self._steps.variant_key(self._step_key(q, logits_to_keep), q, 0) for q in ends)
            jobs.append(GraphJob(name, self, self._steps, keys,
                                 functools.partial(self._build_on_shadow, ends, logits_to_keep)))
        return jobs

    @torch.inference_mode()
    def _build_on_shadow(self, queries: tuple[int, ...], logits_to_keep: int) -> int:
        shadow = self.shadow()
        for q in queries:
            shadow.cache.reset()
            shadow.step(torch.zeros((1, q), dtype=torch.long, device=self.lean.device), logits_to_keep)
        shadow.cache.reset()
        return _stage_shadow_graphs(self._steps, shadow._steps, self.cache, shadow.cache)

    def _give_shadow_a_cache(self, shadow: 'FastCausalLM') -> None:
        shadow.cache = self.lean.new_cache(self.cache.context_limit, self.max_query)



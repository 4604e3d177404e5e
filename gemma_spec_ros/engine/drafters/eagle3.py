"""An EAGLE-3 head drafting from the target's low, middle and high hidden states, with K/V of its own."""

import torch

from ..runtime import FastCausalLM
from ..runtime.model.eagle import Eagle3Head
from ..runtime.steps import causal_lm
from ..runtime.steps.eagle import FastEagle3
from .base import DraftContext, Drafter, DraftRound, LoadContext, Proposal, grammar_lookahead


class Eagle3Drafter(Drafter):
    """
    runtime.model.eagle.Eagle3Head over the target's tapped states (LeanGemma4.feature_layers).

    Every target pass returns its states of every fed position (StepOutput.features); those of the kept positions
    wait here until the next round enters them as true entries, with the tokens after them. A round then drafts one
    token per step, each step entering the last draft with the head's own output as its feature. The drafted entries
    are rolled back before the next round: the head's cache holds true entries only between rounds.

    Its steps run in the target's compile mode (runtime.steps.eagle.FastEagle3). A prompt restored from the prefix
    cache has no states for its reused positions: the head's entries then start after them (its drafts see less of
    the prompt; the output does not change). Needs the lean forward (any engine.compile but transformers); its
    weights stay in the engine's float dtype under engine.quantization; the goals of a batch draft one at a time.
    """

    name = 'eagle3'
    needs_target_states = True

    def __init__(self, head: Eagle3Head, target_lm: FastCausalLM, capacity: int, max_query: int):
        self._head = head
        self._target_lm = target_lm
        self._lean = target_lm.lean
        self._runner = FastEagle3(head, target_lm, capacity, max_query)
        self._cache = self._runner.cache
        self.weights_bytes = causal_lm.parameter_bytes(head)
        self.kv_cache_bytes = self._cache.nbytes
        self._states: torch.Tensor | None = None  # [n, 3 * target_hidden] the target's states not yet entered
        self._states_end = 0                      # the position after the last of them
        self._prompt: list[int] | None = None     # the prompt, until its prefill's states are entered

    @classmethod
    def load(cls, context: LoadContext) -> 'Eagle3Drafter':
        path = context.config.eagle3_path
        context.progress('loading EAGLE-3 head {}'.format(path))
        if not isinstance(context.target_lm, FastCausalLM):
            raise ValueError('the EAGLE-3 head reads target states the lean forward taps: engine.compile must not be '
                             'transformers')
        head = Eagle3Head.load(path, context.device, context.dtype)
        target_config = context.target.config.get_text_config()
        head.check_fits(target_config, path)
        lean = context.target_lm.lean
        if lean.feature_layers not in ((), head.config.feature_layers):
            raise ValueError('EAGLE-3 head {} taps target layers {}; the target already taps {}'.format(
                path, head.config.feature_layers, lean.feature_layers))
        lean.feature_layers = head.config.feature_layers  # before any step is traced (warm-up follows the loads)
        max_draft = context.config.max_draft_tokens
        return cls(head, context.target_lm, context.context_limit + max_draft + 1, max_draft + 1)

    def warmup(self, progress) -> int:
        return self._runner.warmup(progress).graphs

    def graph_jobs(self) -> list:
        return self._runner.graph_jobs(self.name)

    def start(self, prompt_ids: list[int]) -> None:
        self._states, self._states_end, self._prompt = None, 0, prompt_ids
        self._cache.reset(0)

    def observe(self, target_out, num_fed: int, num_kept: int) -> None:
        features = target_out.features
        if features is None:  # a pass without states: the entries start again after the next pass that has them
            self._states = None
            self._cache.reset(0)
            return
        # a prefill returns every prefilled position (num_fed 1: only its last is reported fed); a verify pass its
        # fed positions, of which the first num_kept stay
        rolled_back = num_fed - num_kept
        kept = features[0, :features.shape[1] - rolled_back]
        end = self._target_lm.cache.length  # observed after the rollback: the position after the kept ones
        if self._states is not None and self._states_end == end - kept.shape[0]:
            kept = torch.cat([self._states, kept])
        self._states, self._states_end = kept, end
        self._cache.crop(end - kept.shape[0] + 1)  # its drafted entries: entries past the first state's next position
        if self._prompt is not None:  # the prefill: enter the prompt's entries now, the round's drafting the last one
            self._catch_up(self._prompt, keep=1)
            self._prompt = None

    def has_proposal(self, tokens: list[int]) -> bool:
        return self._states is not None

    def propose(self, context: DraftContext, k: int) -> Proposal | None:
        if self._states is None:
            return None
        hidden, logits = self._catch_up(context.tokens, keep=0)
        with grammar_lookahead(context) as look:
            drafts = DraftRound(context, context.min_confidence, look)
            for step in range(k):
                token, more = drafts.draw(logits)
                if not more or step == k - 1:
                    break
                hidden, logits = self._runner.enter(self._lean.embed_tokens(token)[None], hidden, drafted=True)
        return drafts.proposal()

    def _catch_up(self, tokens: list[int], keep: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """
        Enter the true entries the waiting states allow, but for the last `keep` of them; return the last outputs.

        Entry p takes token p and the state of p - 1: the states of positions a..b give entries a+1..b+1, and
        tokens must reach b + 1 for all of them.
        """
        first_state = self._states_end - self._states.shape[0]
        if self._cache.end != first_state + 1:  # not the entry right after the states: start the entries there
            self._cache.reset(first_state + 1)
        count = self._states.shape[0] - keep
        if count <= 0:
            return None
        ids = torch.tensor(tokens[first_state + 1:first_state + 1 + count], device=self._states.device)
        with torch.inference_mode():
            out = self._runner.enter(self._lean.embed_tokens(ids)[None], self._states[None, :count], drafted=False)
        self._states = self._states[count:] if keep else None
        return out

"""
Training a Gemma4AssistantForCausalLM (MTP drafter) against a frozen Gemma 4 target.

The assistant is fed exactly what it gets at inference (transformers' Gemma4AssistantCandidateGenerator):
to draft the tokens after token x_p at position p, step 1 takes cat(target_embed(x_p), h_{p-1})
where h_{p-1} is the target's final hidden state at p-1, at position id p, attending the target's shared
K/V of positions 0..p-1 (sliding layers: the last `sliding_window` + 1 of them, as its mask allows).
Step j+1 keeps position p and the K/V, and takes cat(target_embed(token p+j), the assistant's own projected
last hidden state of step j).

Training runs all query positions of a window at once: one target forward gives every h and the K/V, and a
[queries, keys] mask gives each query p exactly the keys it would see at inference. Step j is distilled to
the target's own next-token distribution at position p+j-1 (KL), teacher-forcing the window's tokens, which
is exact on the accepted path whenever the window's token is the target's greedy choice.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm

from gemma_spec_ros.train.corpora.data import TokenStream, random_windows
from gemma_spec_ros.train.lm import BatchSettings


@dataclass(frozen=True)
class DraftSteps:
    num_steps: int = 4       # draft steps unrolled in training
    decay: float = 0.8       # loss weight of step j is decay**(j-1)

    def __post_init__(self):
        if self.num_steps < 1 or not 0 < self.decay <= 1:
            raise ValueError(f'draft steps must be >= 1 and decay in (0, 1], got {self}')


@dataclass
class TargetView:
    """What one frozen target forward over a window offers the assistant."""

    embeds: torch.Tensor            # [B, T, H] scaled input embeddings of the window's tokens
    hidden: torch.Tensor            # [B, T, H] final-norm last hidden states
    shared_kv: dict                 # layer type -> (K, V), each [B, kv_heads, T, head_dim]
    log_probs: torch.Tensor         # [B, T, V] target next-token log-probabilities


def text_config_of(model):
    return model.config.get_text_config()


@torch.no_grad()
def target_view(target, ids: torch.Tensor) -> TargetView:
    out = target(input_ids=ids, output_hidden_states=-1, return_shared_kv_states=True, use_cache=False)
    if not out.shared_kv_states or set(out.shared_kv_states) != {'full_attention', 'sliding_attention'}:
        raise ValueError('the target returned no shared K/V for both sliding and full attention; '
                         'it must be a Gemma 4 model with both layer types')
    embeds = target.get_input_embeddings()(ids)
    return TargetView(embeds, out.hidden_states[-1], dict(out.shared_kv_states), F.log_softmax(out.logits.float(), -1))


def attention_masks(num_keys: int, sliding_window: int, dtype: torch.dtype, device) -> dict[str, torch.Tensor]:
    """
    Additive [1, 1, T-1, T] masks: query p (1..T-1) sees keys k < p; sliding layers only k >= p - window - 1.

    The sliding bound is what transformers' flipped bidirectional window mask gives a one-token query over
    full-length K/V (window + 1 keys); a cache that keeps fewer keys hides at most the oldest one.
    """
    queries = torch.arange(1, num_keys, device=device)[:, None]
    keys = torch.arange(num_keys, device=device)[None, :]
    blocked = torch.finfo(dtype).min
    full = torch.where(keys < queries, 0.0, blocked).to(dtype)
    sliding = torch.where((keys < queries) & (keys >= queries - sliding_window - 1), 0.0, blocked).to(dtype)
    return {'full_attention': full[None, None], 'sliding_attention': sliding[None, None]}


def assistant_steps(assistant, view: TargetView, ids: torch.Tensor, steps: DraftSteps):
    """Logits of each draft step for every query position 1..T-1: a list of [B, T-1, V]."""
    return [assistant.lm_head(state) for state in assistant_states(assistant, view, ids, steps)]


def assistant_states(assistant, view: TargetView, ids: torch.Tensor, steps: DraftSteps):
    """Final-norm hidden states (what the LM head reads) of each draft step for queries 1..T-1: [B, T-1, H] each."""
    batch, length = ids.shape
    config = text_config_of(assistant)
    param_dtype = assistant.pre_projection.weight.dtype
    masks = attention_masks(length, config.sliding_window, param_dtype, ids.device)
    positions = torch.arange(1, length, device=ids.device).expand(batch, -1)
    hidden = view.hidden[:, :-1].to(param_dtype)                 # h_{p-1} for queries p = 1..T-1
    states = []
    for j in range(steps.num_steps):
        # token p+j (window positions past the end are clamped; their losses are masked)
        token_index = (positions + j).clamp(max=length - 1)
        embeds = view.embeds.gather(1, token_index[..., None].expand(-1, -1, view.embeds.shape[-1]))
        x = assistant.pre_projection(torch.cat([embeds.to(param_dtype), hidden], -1))
        # logits_to_keep=None: transformers would otherwise try to slice absent per-layer inputs
        out = assistant.model(inputs_embeds=x, attention_mask=masks, position_ids=positions,
                              shared_kv_states=view.shared_kv, use_cache=False, logits_to_keep=None)
        states.append(out.last_hidden_state)
        hidden = assistant.post_projection(out.last_hidden_state)
    return states


def distillation_loss(all_logits: list[torch.Tensor], view: TargetView, steps: DraftSteps) -> torch.Tensor:
    """Sum over steps of decay**j * KL(target || assistant) at the positions each step predicts."""
    total, weights = 0.0, 0.0
    num_queries = all_logits[0].shape[1]
    for j, logits in enumerate(all_logits):
        valid = num_queries - j                                   # step j of query p reads target row p+j
        if valid <= 0:
            break
        teacher = view.log_probs[:, 1 + j:1 + j + valid]
        student = F.log_softmax(logits[:, :valid].float(), -1)
        kl = F.kl_div(student.flatten(0, 1), teacher.flatten(0, 1), log_target=True, reduction='batchmean')
        total = total + steps.decay ** j * kl
        weights += steps.decay ** j
    return total / weights


@torch.no_grad()
def greedy_windows(target, stream: TokenStream, num_windows: int, prompt_len: int, seq_len: int, seed: int,
                   device, batch_size: int = 16) -> torch.Tensor:
    """
    [num_windows, seq_len] windows of corpus prompts continued by the target's own greedy decoding.

    On these windows every teacher-forced token after the prompt is the target's greedy choice, so
    multi-step training sees exactly the accepted path of speculative greedy decoding.
    """
    if not 0 < prompt_len < seq_len:
        raise ValueError(f'prompt length must be in (0, {seq_len}), got {prompt_len}')
    prompts = random_windows(stream, num_windows, prompt_len, torch.Generator().manual_seed(seed))
    new_tokens = seq_len - prompt_len
    windows = []
    for chunk in tqdm(prompts.split(batch_size), desc='greedy target continuations', dynamic_ncols=True):
        out = target.generate(chunk.to(device), attention_mask=torch.ones_like(chunk, device=device),
                              do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              pad_token_id=0)
        windows.append(out[:, :seq_len].cpu())
    return torch.cat(windows)


def drafter_batch(stream: TokenStream, greedy: torch.Tensor | None, batch: BatchSettings, index: int,
                  device) -> torch.Tensor:
    """Step index's windows [B, T]: half from the corpus, half from the target's greedy windows (when given)."""
    generator = batch.generator(index)
    num_greedy = batch.batch_size // 2 if greedy is not None and len(greedy) else 0
    ids = random_windows(stream, batch.batch_size - num_greedy, batch.seq_len, generator)
    if num_greedy:
        rows = torch.randint(0, len(greedy), (num_greedy,), generator=generator)
        ids = torch.cat([ids, greedy[rows, :batch.seq_len]])
    return ids.to(device)


def assistant_step(assistant, target, stream: TokenStream, greedy: torch.Tensor | None, batch: BatchSettings,
                   steps: DraftSteps, device):
    """Half of each batch from corpus windows, half from the target's greedy windows (when given)."""
    def step(index: int) -> tuple[torch.Tensor, int]:
        ids = drafter_batch(stream, greedy, batch, index, device)
        view = target_view(target, ids)
        return distillation_loss(assistant_steps(assistant, view, ids, steps), view, steps), ids.numel()
    return step


@torch.no_grad()
def draft_accuracy(assistant, target, ids: torch.Tensor, steps: DraftSteps) -> list[float]:
    """Per step, the share of queries whose drafted argmax equals the target's argmax (teacher-forced)."""
    view = target_view(target, ids)
    all_logits = assistant_steps(assistant, view, ids, steps)
    accuracy = []
    for j, logits in enumerate(all_logits):
        valid = logits.shape[1] - j
        if valid <= 0:
            break
        hits = logits[:, :valid].argmax(-1) == view.log_probs[:, 1 + j:1 + j + valid].argmax(-1)
        accuracy.append(hits.float().mean().item())
    return accuracy

"""
Training an EAGLE-3 head (engine/runtime/model/eagle.py) against a frozen Gemma 4 target.

One frozen target forward over a window gives, per position, the states the engine taps (the outputs of the head's
two feature layers and the final-norm state, read here through forward hooks), the scaled embeddings and the
target's next-token log-probabilities. The head then runs every drafted depth 0..D-1 at once (training-time test):
depth 0 is each position's true entry, depth s the s-th drafted entry of a chain that started s positions earlier,
fed the head's own output of depth s - 1 at the position before. eagle.training_masks gives each query exactly the
keys the head's cache holds at inference. Depth s at position p is distilled to the target's distribution at p
(KL), teacher-forcing the window's tokens; half of each batch is the target's own greedy continuations, on which the
teacher-forced path is the accepted one.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gemma_spec_ros.engine.runtime.model.eagle import Eagle3Head, training_masks
from gemma_spec_ros.train.assistant import drafter_batch
from gemma_spec_ros.train.corpora.data import TokenStream
from gemma_spec_ros.train.lm import BatchSettings


@dataclass
class TargetStates:
    """What one frozen target forward over windows [B, T] gives the head."""

    embeds: torch.Tensor     # [B, T, target_hidden] scaled input embeddings
    features: torch.Tensor   # [B, T, 3 * target_hidden] low, middle, final-norm states (StepOutput.features)
    log_probs: torch.Tensor  # [B, T, vocab] the target's next-token log-probabilities


def _text_model(target):
    model = target.model
    return getattr(model, 'language_model', model)  # Gemma4ForConditionalGeneration keeps the text model inside


@torch.no_grad()
def target_states(target, ids: torch.Tensor, feature_layers: tuple[int, int]) -> TargetStates:
    """Run the frozen target over ids [B, T]; tap its feature layers' outputs and its final norm."""
    text = _text_model(target)
    taps: dict[str, torch.Tensor] = {}

    def keep(name):
        def hook(module, inputs, output):
            taps[name] = output[0] if isinstance(output, tuple) else output
        return hook

    handles = [text.layers[index].register_forward_hook(keep(str(index))) for index in feature_layers]
    handles.append(text.norm.register_forward_hook(keep('norm')))
    try:
        out = target(input_ids=ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    features = torch.cat([taps[str(index)] for index in feature_layers] + [taps['norm']], dim=-1)
    return TargetStates(target.get_input_embeddings()(ids), features, F.log_softmax(out.logits.float(), -1))


def depth_logits(head: Eagle3Head, states: TargetStates, depth: int) -> list[torch.Tensor]:
    """
    Logits of each drafted depth 0..depth-1 for the entries at positions 1..T-1: a list of [B, T-1, vocab].

    Depth s at entry i (position i + 1) is meaningful for i >= s (its chain starts at a position >= 1); the others
    are computed and left out of the loss.
    """
    batch, length, _ = states.embeds.shape
    dtype = head.fuse.weight.dtype
    embeds = states.embeds[:, 1:].to(dtype)                                      # x_p, p = 1..T-1
    feature = head.fuse_target(states.features[:, :-1].to(dtype))                 # f_{p-1}
    positions = torch.arange(1, length, device=embeds.device)
    keys, values, all_logits = [], [], []
    for level in range(depth):
        x, query, key, value = head.project(embeds, feature, positions)
        keys.append(key)
        values.append(value)
        mask = training_masks(length - 1, level, embeds.device)
        hidden = head.finish(x, query, torch.cat(keys, dim=2), torch.cat(values, dim=2), mask)
        all_logits.append(head.logits(hidden))
        # the next depth at p reads this depth's output at p - 1 (its first entry reads nothing meaningful)
        feature = torch.cat([hidden[:, :1], hidden[:, :-1]], dim=1)
    return all_logits


def distillation_loss(all_logits: list[torch.Tensor], states: TargetStates, decay: float) -> torch.Tensor:
    """Sum over depths of decay**s * KL(target || head) over the entries each depth is meaningful at."""
    total, weights = 0.0, 0.0
    for level, logits in enumerate(all_logits):
        if logits.shape[1] <= level:
            break
        teacher = states.log_probs[:, 1 + level:]                  # entry i is position i + 1
        student = F.log_softmax(logits[:, level:].float(), -1)
        kl = F.kl_div(student.flatten(0, 1), teacher.flatten(0, 1), log_target=True, reduction='batchmean')
        total = total + decay ** level * kl
        weights += decay ** level
    return total / weights


def eagle3_step(head: Eagle3Head, target, stream: TokenStream, greedy: torch.Tensor | None, batch: BatchSettings,
                depth: int, decay: float, device):
    """Half of each batch from corpus windows, half from the target's greedy windows (when given)."""
    def step(index: int) -> tuple[torch.Tensor, int]:
        ids = drafter_batch(stream, greedy, batch, index, device)
        states = target_states(target, ids, head.config.feature_layers)
        return distillation_loss(depth_logits(head, states, depth), states, decay), ids.numel()
    return step


@torch.no_grad()
def draft_accuracy(head: Eagle3Head, target, ids: torch.Tensor, depth: int) -> list[float]:
    """Per depth, the share of entries whose argmax equals the target's (teacher-forced)."""
    states = target_states(target, ids, head.config.feature_layers)
    accuracy = []
    for level, logits in enumerate(depth_logits(head, states, depth)):
        hits = logits[:, level:].argmax(-1) == states.log_probs[:, 1 + level:].argmax(-1)
        accuracy.append(hits.float().mean().item())
    return accuracy


def initial_head(config, target) -> Eagle3Head:
    """Make a fresh head; its LM head starts as the target's where the widths agree."""
    head = Eagle3Head(config)
    for module in head.modules():
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.normal_(module.weight, std=0.02)
    if config.hidden_size == config.target_hidden_size:
        head.lm_head.weight.data.copy_(target.get_output_embeddings().weight.float())
        head.final_norm.weight.data.copy_(_text_model(target).norm.weight.float())
    return head

"""The shared training loop: AdamW, warmup + cosine, tqdm, safetensors checkpoints, resume, time limit."""

import json
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm


@dataclass
class LoopSettings:
    steps: int                  # planned optimizer steps (sets the learning-rate schedule)
    learning_rate: float
    run_dir: Path               # checkpoints and optimizer state (never committed)
    warmup_steps: int = 50
    weight_decay: float = 0.01
    checkpoint_every: int = 200
    max_minutes: float = 0.0    # stop early (with a checkpoint) after this wall time; 0 = no limit
    resume: bool = False

    def __post_init__(self):
        if self.steps < 1 or self.learning_rate <= 0 or self.checkpoint_every < 1:
            raise ValueError('steps, learning rate and checkpoint interval must be positive')


@dataclass
class LoopResult:
    steps_done: int
    tokens_seen: int
    wall_seconds: float
    last_loss: float


StepFn = Callable[[int], tuple[torch.Tensor, int]]   # step -> (loss, tokens in this step)


def learning_rate_at(step: int, settings: LoopSettings) -> float:
    if step < settings.warmup_steps:
        return settings.learning_rate * (step + 1) / settings.warmup_steps
    progress = min(1.0, (step - settings.warmup_steps) / max(1, settings.steps - settings.warmup_steps))
    return settings.learning_rate * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def save_checkpoint(model: torch.nn.Module, optimizer, state: dict, run_dir: Path) -> None:
    """model.safetensors + optimizer.pt + state.json, written to a temp dir then swapped in."""
    tmp, final = run_dir / 'checkpoint.tmp', run_dir / 'checkpoint'
    tmp.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    unique = {}
    seen = set()
    for name, tensor in tensors.items():   # safetensors refuses shared storage (tied embeddings)
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            unique[name] = tensor
    save_file(unique, tmp / 'model.safetensors')
    torch.save(optimizer.state_dict(), tmp / 'optimizer.pt')
    (tmp / 'state.json').write_text(json.dumps(state))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)


def load_checkpoint(model: torch.nn.Module, optimizer, run_dir: Path) -> dict:
    checkpoint = run_dir / 'checkpoint'
    if not (checkpoint / 'state.json').exists():
        raise ValueError(f'--resume given but no checkpoint in {checkpoint}')
    missing, _ = model.load_state_dict(load_file(checkpoint / 'model.safetensors'), strict=False)
    if any('embed' not in name and 'lm_head' not in name for name in missing):
        raise ValueError(f'checkpoint in {checkpoint} does not match the model: missing {missing[:3]}')
    model.tie_weights()
    optimizer.load_state_dict(torch.load(checkpoint / 'optimizer.pt'))
    return json.loads((checkpoint / 'state.json').read_text())


def train_loop(model: torch.nn.Module, step_fn: StepFn, settings: LoopSettings, description: str,
               extra_state: dict | None = None, lr_multipliers: dict[str, float] | None = None) -> LoopResult:
    """
    Optimize the trainable parameters of model with step_fn's loss; checkpoints into settings.run_dir.

    lr_multipliers: parameter-name prefix -> factor on the learning rate (e.g. a layer whose weights are large).
    """
    multipliers = lr_multipliers or {}
    groups: dict[tuple[float, bool], list[torch.nn.Parameter]] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            factor = next((f for prefix, f in multipliers.items() if name.startswith(prefix)), 1.0)
            groups.setdefault((factor, p.dim() >= 2), []).append(p)
    params = [p for group in groups.values() for p in group]
    ordered = sorted(groups.items(), key=lambda item: (item[0][0], not item[0][1]))  # decay first, as before
    optimizer = torch.optim.AdamW([{'params': group, 'lr_multiplier': factor,
                                    'weight_decay': settings.weight_decay if decays else 0.0}
                                   for (factor, decays), group in ordered],
                                  lr=settings.learning_rate, betas=(0.9, 0.95))
    state = {'step': 0, 'tokens': 0, 'wall_seconds': 0.0, 'settings': {
        k: str(v) for k, v in asdict(settings).items()}, **(extra_state or {})}
    if settings.resume:
        state = load_checkpoint(model, optimizer, settings.run_dir)
    start, done_before, loss_value = time.time(), state['wall_seconds'], float('nan')
    model.train()
    bar = tqdm(total=settings.steps, initial=state['step'], desc=description, dynamic_ncols=True, mininterval=2)
    while state['step'] < settings.steps:
        for group in optimizer.param_groups:
            # a checkpoint from before lr_multipliers has none
            group['lr'] = learning_rate_at(state['step'], settings) * group.get('lr_multiplier', 1.0)
        loss, tokens = step_fn(state['step'])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        loss_value = loss.item()
        state['step'] += 1
        state['tokens'] += tokens
        state['wall_seconds'] = done_before + time.time() - start
        bar.update(1)
        bar.set_postfix(loss=f'{loss_value:.3f}', tok_s=f"{state['tokens'] / max(state['wall_seconds'], 1e-9):.0f}")
        out_of_time = settings.max_minutes and time.time() - start > 60 * settings.max_minutes
        if state['step'] % settings.checkpoint_every == 0 or out_of_time or state['step'] == settings.steps:
            save_checkpoint(model, optimizer, state, settings.run_dir)
        if out_of_time:
            bar.write(f"time limit reached after {state['step']} steps")
            break
    bar.close()
    model.eval()
    return LoopResult(state['step'], state['tokens'], state['wall_seconds'], loss_value)

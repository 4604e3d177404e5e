"""Training a Gemma4ForCausalLM: the target from scratch, or a draft model distilled from a target."""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import Gemma4ForCausalLM

from gemma_spec_ros.train.data import TokenStream, fixed_windows, random_windows


@dataclass
class BatchSettings:
    batch_size: int
    seq_len: int
    seed: int

    def __post_init__(self):
        if self.batch_size < 1 or self.seq_len < 2:
            raise ValueError(f'batch size must be >= 1 and sequence length >= 2, got {self}')

    def generator(self, step: int) -> torch.Generator:
        """Per-step generator, so a resumed run draws the same batches as an uninterrupted one."""
        return torch.Generator().manual_seed(self.seed * 1_000_003 + step)


def lm_step(model: Gemma4ForCausalLM, stream: TokenStream, batch: BatchSettings, device: torch.device):
    """Next-token cross-entropy on a random batch."""
    def step(index: int) -> tuple[torch.Tensor, int]:
        ids = random_windows(stream, batch.batch_size, batch.seq_len + 1, batch.generator(index)).to(device)
        logits = model(input_ids=ids[:, :-1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())
        return loss, ids[:, :-1].numel()
    return step


def distill_step(student: Gemma4ForCausalLM, teacher: Gemma4ForCausalLM, stream: TokenStream,
                 batch: BatchSettings, device: torch.device, temperature: float = 1.0):
    """KL(teacher || student) on the teacher's next-token distributions over a random batch."""
    def step(index: int) -> tuple[torch.Tensor, int]:
        ids = random_windows(stream, batch.batch_size, batch.seq_len, batch.generator(index)).to(device)
        with torch.no_grad():
            teacher_logp = F.log_softmax(teacher(input_ids=ids).logits.float() / temperature, -1)
        student_logp = F.log_softmax(student(input_ids=ids).logits.float() / temperature, -1)
        loss = F.kl_div(student_logp.flatten(0, 1), teacher_logp.flatten(0, 1), log_target=True,
                        reduction='batchmean')
        return loss, ids.numel()
    return step


@torch.no_grad()
def perplexity(model: Gemma4ForCausalLM, stream: TokenStream, seq_len: int, max_windows: int,
               device: torch.device, batch_size: int = 8) -> float:
    """exp(mean next-token cross-entropy) over consecutive held-out windows."""
    windows = fixed_windows(stream, seq_len, max_windows)
    total, count = 0.0, 0
    for chunk in windows.split(batch_size):
        chunk = chunk.to(device)
        logits = model(input_ids=chunk[:, :-1]).logits.float()
        total += F.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten(), reduction='sum').item()
        count += chunk[:, 1:].numel()
    return math.exp(total / count)

"""
Speculative verification: one pure function over tensors (no model inside).

Vocabulary (as in vLLM's rejection sampler): output tokens = accepted draft tokens + one recovered token (drawn at
the first rejection) or one bonus token (drawn after all drafts were accepted).
"""

import torch


def verify(
    draft_tokens: torch.Tensor,           # [batch, k] proposed tokens
    target_probs: torch.Tensor,           # [batch, k + 1, vocab] target distributions (logits are fine when greedy)
    draft_probs: torch.Tensor | None,     # [batch, k, vocab] what the drafts were sampled from; None = one-hot
    greedy: bool,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """
    Accept a prefix of the drafts and pick the next token; returns (num_accepted [batch], next_token [batch]).

    greedy: accept while the draft equals the target argmax; the next token is the target argmax after the prefix.
    sampling: accept draft x with probability min(1, target_prob(x) / draft_prob(x)); at the first rejection draw the
    recovered token from normalize(max(0, target_probs - draft_probs)); if all k are accepted draw the bonus token
    from target_probs[k]. A deterministic proposal (draft_probs None) has a one-hot draft distribution, so the rule
    reduces to accepting with probability target_prob(x) and resampling with x removed. The output then follows
    the target distribution exactly.
    """
    batch, k = draft_tokens.shape
    if k == 0:  # plain decoding: the target's own pick
        next_token = (target_probs[:, 0].argmax(dim=-1) if greedy
                      else torch.multinomial(target_probs[:, 0].float(), 1, generator=generator).squeeze(-1))
        return torch.zeros_like(next_token), next_token
    rows = torch.arange(batch, device=draft_tokens.device)
    if greedy:
        target_tokens = target_probs.argmax(dim=-1)                                   # [batch, k + 1]
        accepted = draft_tokens == target_tokens[:, :k]                                # [batch, k]
        num_accepted = accepted.long().cumprod(dim=-1).sum(dim=-1)                     # [batch]
        return num_accepted, target_tokens[rows, num_accepted]

    target_probs = target_probs.float()
    target_of_draft = target_probs[:, :k].gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)   # [batch, k]
    if draft_probs is None:
        draft_of_draft = torch.ones_like(target_of_draft)
    else:
        draft_probs = draft_probs.float()
        draft_of_draft = draft_probs.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)        # [batch, k]
    uniform = torch.rand(target_of_draft.shape, generator=generator, device=target_of_draft.device)
    accepted = uniform * draft_of_draft < target_of_draft                                  # [batch, k]
    num_accepted = accepted.long().cumprod(dim=-1).sum(dim=-1)                             # [batch]

    # the recovered token comes from the residual at the first rejection; the bonus token from the target
    next_target = target_probs[rows, num_accepted]                                        # [batch, vocab]
    rejected_at = num_accepted.clamp(max=k - 1)
    if draft_probs is None:
        next_draft = torch.zeros_like(next_target)
        next_draft[rows, draft_tokens[rows, rejected_at]] = 1.0
    else:
        next_draft = draft_probs[rows, rejected_at]                                        # [batch, vocab]
    residual = (next_target - next_draft).clamp(min=0.0)
    residual_mass = residual.sum(dim=-1, keepdim=True)
    use_residual = (num_accepted < k).unsqueeze(-1) & (residual_mass > 0)
    next_target = torch.where(use_residual, residual / residual_mass.clamp(min=1e-30), next_target)
    next_token = torch.multinomial(next_target, 1, generator=generator).squeeze(-1)
    return num_accepted, next_token

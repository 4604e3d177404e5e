"""
Fitting the MTP assistant's ordered-embedding (centroid) LM head, Gemma 4's sparse drafter head.

The full head multiplies the final hidden state by every row of the (tied) embedding table: for the bundled
assistant that is 4,096 x 256 weights, half of its bytes and of its step time on a memory-bound CPU. The
ordered head groups the vocabulary into equal clusters (``token_ordering``), scores the cluster centroids, and
computes exact logits only for the tokens of the top clusters; the rest get a floor below them.

Fitting: balanced k-means over the embedding rows gives the clusters; the centroids start at the cluster means
and are then trained (cross-entropy) to pick the cluster that holds the full head's argmax, on the assistant's
own final hidden states along the target's greedy path. The assistant's other weights are unchanged. Drafts only
change where the full head's argmax falls outside the selected clusters, and output stays lossless either way:
the target verifies every draft.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gemma_spec_ros.train.assistant import DraftSteps, assistant_states, target_view


@dataclass(frozen=True)
class OrderedHeadShape:
    num_centroids: int   # clusters; must divide the vocabulary
    top_k: int           # clusters whose tokens get exact logits

    def check(self, vocab_size: int) -> None:
        if self.num_centroids < 2 or vocab_size % self.num_centroids:
            raise ValueError(f'--centroids must be >= 2 and divide the vocabulary ({vocab_size}), '
                             f'got {self.num_centroids}')
        if not 1 <= self.top_k < self.num_centroids:
            raise ValueError(f'--top-k must be in 1..{self.num_centroids - 1}, got {self.top_k}')

    def rows_read(self, vocab_size: int) -> int:
        """Head rows one draft step reads: every centroid plus the tokens of the top clusters."""
        return self.num_centroids + self.top_k * vocab_size // self.num_centroids


@dataclass
class DraftFeatures:
    """The assistant's final hidden states along the target's greedy path, with the tokens they should draft."""

    states: torch.Tensor          # [N, hidden]
    full_argmax: torch.Tensor     # [N] the full head's draft
    target_argmax: torch.Tensor   # [N] the target's greedy token at that position


def balanced_clusters(embeddings: torch.Tensor, num_clusters: int, iterations: int,
                      generator: torch.Generator) -> torch.Tensor:
    """Cluster of each row of embeddings [V, H] by k-means with every cluster holding exactly V / num_clusters rows."""
    size = embeddings.shape[0] // num_clusters
    centers = embeddings[torch.randperm(embeddings.shape[0], generator=generator)[:num_clusters]]
    assignment = _assign_with_capacity(torch.cdist(embeddings, centers), size)
    for _ in range(iterations - 1):
        centers = cluster_means(embeddings, assignment, num_clusters)
        assignment = _assign_with_capacity(torch.cdist(embeddings, centers), size)
    return assignment


def cluster_means(embeddings: torch.Tensor, assignment: torch.Tensor, num_clusters: int) -> torch.Tensor:
    """Mean row of each cluster: [C, H]."""
    return torch.stack([embeddings[assignment == c].mean(0) for c in range(num_clusters)])


def _assign_with_capacity(distances: torch.Tensor, size: int) -> torch.Tensor:
    """Nearest-first assignment of rows to columns of distances [V, C], at most size rows per column."""
    num_rows, num_clusters = distances.shape
    order = distances.flatten().argsort().tolist()
    assignment = [-1] * num_rows
    counts = [0] * num_clusters
    remaining = num_rows
    for flat in order:
        row, cluster = divmod(flat, num_clusters)
        if assignment[row] < 0 and counts[cluster] < size:
            assignment[row] = cluster
            counts[cluster] += 1
            remaining -= 1
            if not remaining:
                break
    return torch.tensor(assignment)


def token_ordering(assignment: torch.Tensor) -> torch.Tensor:
    """[V] token ids grouped by cluster: row c of ordering.view(C, -1) holds cluster c's tokens."""
    return torch.argsort(assignment, stable=True)


@torch.no_grad()
def draft_features(assistant, target, windows: torch.Tensor, steps: DraftSteps, batch_size: int) -> DraftFeatures:
    """Features (on the CPU) of every draft step of every query of windows [N, T] (target greedy continuations)."""
    states, full, wanted = [], [], []
    for chunk in windows.split(batch_size):
        view = target_view(target, chunk)
        for j, step_states in enumerate(assistant_states(assistant, view, chunk, steps)):
            valid = step_states.shape[1] - j          # step j of query p predicts the token at p + j + 1
            if valid <= 0:
                break
            kept = step_states[:, :valid]
            states.append(kept.flatten(0, 1).float().cpu())
            full.append(assistant.lm_head(kept).argmax(-1).flatten().cpu())
            wanted.append(view.log_probs[:, 1 + j:1 + j + valid].argmax(-1).flatten().cpu())
    return DraftFeatures(torch.cat(states), torch.cat(full), torch.cat(wanted))


def fit_centroids(features: DraftFeatures, embeddings: torch.Tensor, assignment: torch.Tensor, num_clusters: int,
                  epochs: int, learning_rate: float, generator: torch.Generator) -> torch.Tensor:
    """Centroids [C, H]: cluster means, trained to score highest the cluster of the full head's argmax."""
    centroids = cluster_means(embeddings, assignment, num_clusters).requires_grad_(True)
    optimizer = torch.optim.Adam([centroids], lr=learning_rate)
    labels = assignment[features.full_argmax]
    batch = 4096
    with torch.enable_grad():
        for _ in range(epochs):
            for rows in torch.randperm(len(labels), generator=generator).split(batch):
                loss = F.cross_entropy(features.states[rows] @ centroids.T, labels[rows])
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
    return centroids.detach()


@torch.no_grad()
def ordered_drafts(states: torch.Tensor, embeddings: torch.Tensor, centroids: torch.Tensor,
                   ordering: torch.Tensor, top_k: int) -> torch.Tensor:
    """Return the ordered head's argmax [N] for states [N, H], as Gemma4AssistantMaskedEmbedder computes it."""
    top = (states @ centroids.T).topk(top_k, dim=-1).indices                     # [N, top_k]
    selected = ordering.view(centroids.shape[0], -1)[top].flatten(1)              # [N, top_k * per cluster]
    logits = torch.einsum('nh,nsh->ns', states, embeddings[selected])
    return selected.gather(1, logits.argmax(-1, keepdim=True))[:, 0]


def agreement(features: DraftFeatures, drafts: torch.Tensor) -> dict[str, float]:
    """How often drafts match the full head's draft and the target's token (the full head's own rate beside)."""
    return {'same_as_full_head': round((drafts == features.full_argmax).float().mean().item(), 4),
            'target_match': round((drafts == features.target_argmax).float().mean().item(), 4),
            'full_head_target_match': round((features.full_argmax == features.target_argmax).float().mean().item(),
                                            4)}

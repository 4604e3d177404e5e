"""The ordered-embedding (centroid) head fitting for the MTP assistant: pure functions on hand-built data."""

import pytest
import torch

from gemma_spec_ros.train.ordered_head import (
    DraftFeatures,
    OrderedHeadShape,
    agreement,
    balanced_clusters,
    cluster_means,
    fit_centroids,
    ordered_drafts,
    token_ordering,
)


def _blobs(num_clusters: int, per_cluster: int, hidden: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows in well-separated blobs, shuffled: (rows [C * per, hidden], true cluster of each row)."""
    generator = torch.Generator().manual_seed(seed)
    centers = 10 * torch.randn(num_clusters, hidden, generator=generator)
    truth = torch.arange(num_clusters).repeat_interleave(per_cluster)
    rows = centers[truth] + 0.1 * torch.randn(len(truth), hidden, generator=generator)
    order = torch.randperm(len(truth), generator=generator)
    return rows[order], truth[order]


def test_balanced_clusters_are_equal_and_recover_separated_groups():
    rows, truth = _blobs(num_clusters=8, per_cluster=16, hidden=12, seed=0)
    assignment = balanced_clusters(rows, 8, iterations=6, generator=torch.Generator().manual_seed(1))
    assert torch.bincount(assignment, minlength=8).tolist() == [16] * 8
    for cluster in range(8):   # every found cluster is one true blob
        assert len(set(truth[assignment == cluster].tolist())) == 1


def test_token_ordering_groups_each_cluster_in_its_row():
    assignment = torch.tensor([2, 0, 1, 0, 2, 1])
    ordering = token_ordering(assignment)
    assert sorted(ordering.tolist()) == list(range(6))
    assert [sorted(row) for row in ordering.view(3, 2).tolist()] == [[1, 3], [2, 5], [0, 4]]


def test_ordered_drafts_match_transformers_masked_embedder():
    from transformers import Gemma4AssistantConfig
    from transformers.models.gemma4_assistant.modeling_gemma4_assistant import Gemma4AssistantMaskedEmbedder

    text = {'vocab_size': 64, 'hidden_size': 16, 'hidden_size_per_layer_input': 0, 'vocab_size_per_layer_input': 0}
    config = Gemma4AssistantConfig(use_ordered_embeddings=True, num_centroids=8, centroid_intermediate_top_k=3,
                                   text_config=text)
    embedder = Gemma4AssistantMaskedEmbedder(config)
    generator = torch.Generator().manual_seed(3)
    torch.nn.init.normal_(embedder.centroids.weight, generator=generator)
    embedder.token_ordering.copy_(torch.randperm(64, generator=generator))
    embeddings = torch.randn(64, 16, generator=generator)
    states = torch.randn(20, 16, generator=generator)
    with torch.no_grad():
        expected = torch.stack([embedder(state[None, None], embeddings)[0, 0].argmax() for state in states])
    drafts = ordered_drafts(states, embeddings, embedder.centroids.weight.detach(), embedder.token_ordering, 3)
    assert drafts.tolist() == expected.tolist()


def test_fitted_centroids_find_the_argmax_cluster_more_often_than_cluster_means():
    generator = torch.Generator().manual_seed(5)
    embeddings = torch.randn(128, 16, generator=generator)
    assignment = balanced_clusters(embeddings, 16, iterations=4, generator=generator)
    ordering = token_ordering(assignment)
    states = 3 * torch.randn(4000, 16, generator=generator)
    full = (states @ embeddings.T).argmax(-1)
    features = DraftFeatures(states, full, full)
    means = cluster_means(embeddings, assignment, 16)
    fitted = fit_centroids(features, embeddings, assignment, 16, epochs=30, learning_rate=5e-2, generator=generator)
    before = agreement(features, ordered_drafts(states, embeddings, means, ordering, 4))['same_as_full_head']
    after = agreement(features, ordered_drafts(states, embeddings, fitted, ordering, 4))['same_as_full_head']
    assert after > before + 0.03 and after > 0.78


def test_ordered_head_shape_checks_and_counts_rows():
    assert OrderedHeadShape(128, 16).rows_read(4096) == 128 + 16 * 32
    with pytest.raises(ValueError, match='divide the vocabulary'):
        OrderedHeadShape(100, 4).check(4096)
    with pytest.raises(ValueError, match='--top-k'):
        OrderedHeadShape(64, 64).check(4096)

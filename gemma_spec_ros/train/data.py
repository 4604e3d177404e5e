"""Token streams and random training windows."""

from dataclasses import dataclass

import torch

from gemma_spec_ros.train.corpus import Document


@dataclass
class TokenStream:
    """All documents tokenized and joined as <bos> doc <eos> <bos> doc <eos> ..."""

    ids: torch.Tensor   # [N] int32

    @classmethod
    def from_documents(cls, tokenizer, documents: list[Document]) -> 'TokenStream':
        encoded = tokenizer([d.text for d in documents], add_special_tokens=False)['input_ids']
        bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
        ids = [token for doc in encoded for token in (bos, *doc, eos)]
        return cls(torch.tensor(ids, dtype=torch.int32))

    def __len__(self) -> int:
        return len(self.ids)


def random_windows(stream: TokenStream, batch_size: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
    """[batch_size, seq_len] windows at random offsets."""
    if len(stream) <= seq_len:
        raise ValueError(f'corpus has {len(stream)} tokens, fewer than one window of {seq_len + 1}')
    starts = torch.randint(0, len(stream) - seq_len, (batch_size,), generator=generator)
    return torch.stack([stream.ids[s:s + seq_len] for s in starts.tolist()]).long()


def fixed_windows(stream: TokenStream, seq_len: int, max_windows: int) -> torch.Tensor:
    """Consecutive non-overlapping windows for evaluation, at most max_windows of them."""
    count = min(len(stream) // seq_len, max_windows)
    if count == 0:
        raise ValueError(f'evaluation corpus has {len(stream)} tokens, fewer than one window of {seq_len}')
    return stream.ids[:count * seq_len].view(count, seq_len).long()

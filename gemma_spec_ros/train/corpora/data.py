"""Token streams and random training windows."""

from dataclasses import dataclass

import torch

from gemma_spec_ros.train.corpora.corpus import Document

CHAT_PREFIX = '<|turn>'


@dataclass
class TokenStream:
    """
    All documents tokenized and joined as <bos> doc <eos> <bos> doc <eos> ...

    Conversations (documents that open with a chat turn, CHAT_PREFIX) are kept whole where a window can hold them:
    a random window that starts inside one starts at its <bos> instead, so the turn that answers sees the system
    turn (the tools and the scene) it depends on.
    """

    ids: torch.Tensor                        # [N] int32
    chat_spans: torch.Tensor | None = None   # [M, 2] int64: start (<bos>) and end of each conversation, sorted

    @classmethod
    def from_documents(cls, tokenizer, documents: list[Document]) -> 'TokenStream':
        encoded = tokenizer([d.text for d in documents], add_special_tokens=False)['input_ids']
        bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
        ids, spans = [], []
        for document, doc in zip(documents, encoded, strict=True):
            if document.text.startswith(CHAT_PREFIX):
                spans.append((len(ids), len(ids) + len(doc) + 2))
            ids += (bos, *doc, eos)
        return cls(torch.tensor(ids, dtype=torch.int32), torch.tensor(spans, dtype=torch.int64).view(-1, 2)
                   if spans else None)

    def __len__(self) -> int:
        return len(self.ids)


def random_windows(stream: TokenStream, batch_size: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
    """[batch_size, seq_len] windows at random offsets."""
    if len(stream) <= seq_len:
        raise ValueError(f'corpus has {len(stream)} tokens, fewer than one window of {seq_len + 1}')
    starts = torch.randint(0, len(stream) - seq_len, (batch_size,), generator=generator)
    if stream.chat_spans is not None:   # a start inside a conversation moves back to the conversation's <bos>
        spans = stream.chat_spans.contiguous()
        index = torch.searchsorted(spans[:, 0].contiguous(), starts, right=True) - 1
        inside = (index >= 0) & (starts < spans[index.clamp(min=0), 1]) & \
            (spans[index.clamp(min=0), 1] - spans[index.clamp(min=0), 0] <= seq_len)
        starts = torch.where(inside, spans[index.clamp(min=0), 0], starts)
    return torch.stack([stream.ids[s:s + seq_len] for s in starts.tolist()]).long()


def fixed_windows(stream: TokenStream, seq_len: int, max_windows: int) -> torch.Tensor:
    """Consecutive non-overlapping windows for evaluation, at most max_windows of them."""
    count = min(len(stream) // seq_len, max_windows)
    if count == 0:
        raise ValueError(f'evaluation corpus has {len(stream)} tokens, fewer than one window of {seq_len}')
    return stream.ids[:count * seq_len].view(count, seq_len).long()

"""
A static KV cache: buffers preallocated once, written at positions given as tensors, rolled back by moving a length.

Full-attention layers keep one slot per position (slot = position). Sliding-window layers keep a ring of
``window + max_query + 1`` slots (slot = position % ring) and a tensor that says which position each slot holds, so
attention masks come from tensors and one step graph serves every position. The slack beyond the window is what a
rejected draft may overwrite: the ``window + 1`` positions before the cache length (what the target and the MTP
assistant read) are never touched by a rollback of up to ``max_query`` tokens.
"""

from dataclasses import dataclass

import torch

FULL = 'full_attention'
SLIDING = 'sliding_attention'
EMPTY_POSITION = -(2 ** 40)  # what an unwritten ring slot holds: outside every window


@dataclass(frozen=True)
class KvLayerSpec:
    """One KV-producing decoder layer."""

    layer_index: int
    layer_type: str       # FULL or SLIDING
    num_kv_heads: int
    head_dim: int


class StaticKvCache:
    """
    Preallocated K/V for one model at batch size 1.

    keys[i], values[i]: [kv_heads, slots, head_dim] for producing layer i (in ``specs`` order). ``length`` counts the
    tokens the cache holds (positions 0..length-1); writes past it are provisional until ``crop`` drops them.
    """

    def __init__(self, specs: list[KvLayerSpec], context_limit: int, sliding_window: int, max_query: int,
                 device: torch.device | str, dtype: torch.dtype):
        if context_limit < 1:
            raise ValueError('context_limit must be >= 1, got {}'.format(context_limit))
        if max_query < 1:
            raise ValueError('max_query must be >= 1, got {}'.format(max_query))
        self.specs = list(specs)
        self.context_limit = context_limit
        self.sliding_window = sliding_window
        self.max_query = max_query
        self.ring_size = min(context_limit, sliding_window + max_query + 1)
        self.device = torch.device(device)
        self.dtype = dtype
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        for spec in self.specs:
            slots = self.ring_size if spec.layer_type == SLIDING else context_limit
            shape = (spec.num_kv_heads, slots, spec.head_dim)
            self.keys.append(torch.zeros(shape, device=self.device, dtype=dtype))
            self.values.append(torch.zeros(shape, device=self.device, dtype=dtype))
        self.ring_positions = torch.full((self.ring_size,), EMPTY_POSITION, device=self.device, dtype=torch.long)
        self.key_positions = torch.arange(context_limit, device=self.device)  # [context_limit] full-layer slots
        self.length = 0
        self._written_end = 0   # highest position written since reset, + 1

    def tensors(self) -> list[torch.Tensor]:
        """Every buffer of the cache, in a fixed order (the same for two caches of one model)."""
        return [*self.keys, *self.values, self.ring_positions, self.key_positions]

    @property
    def nbytes(self) -> int:
        """Bytes held by the cache buffers."""
        return sum(tensor.numel() * tensor.element_size() for tensor in self.tensors())

    @property
    def max_rollback(self) -> int:
        """How far past the final length writes may go and still be rolled back (sliding-ring slack)."""
        return self.ring_size - self.sliding_window - 1 if self.ring_size < self.context_limit else self.context_limit

    def reset(self) -> None:
        """Forget every token (a new request); the buffers are kept."""
        self.ring_positions.fill_(EMPTY_POSITION)
        self.length = 0
        self._written_end = 0

    def check_write(self, start: int, count: int) -> None:
        """Raise ValueError unless positions start..start+count-1 may be written now."""
        if not 0 <= start <= self.length:
            raise ValueError('a write must start within the cached tokens (0..{}), got position {}'.format(
                self.length, start))
        if start + count > self.context_limit:
            raise ValueError('positions up to {} exceed the cache context_limit of {} tokens'.format(
                start + count, self.context_limit))

    def advance(self, start: int, count: int) -> None:
        """Record that positions start..start+count-1 were written (the cache then holds start+count tokens)."""
        self.length = start + count
        self._written_end = max(self._written_end, self.length)

    def crop(self, tokens_to_remove: int) -> None:
        """
        Drop the last -tokens_to_remove tokens (DynamicCache convention: a negative count; 0 is a no-op).

        Nothing is copied: the length moves back and later writes overwrite the dropped slots.
        """
        if tokens_to_remove > 0:
            raise ValueError('crop takes a negative count of tokens to remove, got {}'.format(tokens_to_remove))
        new_length = self.length + tokens_to_remove
        if new_length < 0:
            raise ValueError('cannot remove {} tokens from a cache holding {}'.format(-tokens_to_remove, self.length))
        if self._written_end - new_length > self.max_rollback:
            raise ValueError('rolling back to {} tokens after writing up to {} exceeds the sliding-window slack of '
                             '{} tokens (max_query); sliding K/V needed after the rollback was overwritten'.format(
                                 new_length, self._written_end, self.max_rollback))
        self.length = new_length

    def write_slots(self, layer_type: str, positions: torch.Tensor) -> torch.Tensor:
        """Buffer slots [q] of positions [q] for a layer type."""
        return positions % self.ring_size if layer_type == SLIDING else positions

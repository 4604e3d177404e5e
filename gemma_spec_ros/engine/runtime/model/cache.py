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


class SequenceLedger:
    """
    Which positions of one sequence a static cache holds.

    ``length`` tokens (positions 0..length-1), and how far provisional writes went past it (what a rollback may drop
    while the sliding ring still holds the window).
    """

    def __init__(self, context_limit: int, max_rollback: int):
        self.context_limit = context_limit
        self.max_rollback = max_rollback  # how far past the final length writes may go and still be rolled back
        self.length = 0
        self._written_end = 0   # highest position written since reset, + 1

    def forget(self) -> None:
        """Forget every token (a new request)."""
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


def _ring_size(capacity: int, sliding_window: int, max_query: int) -> int:
    return min(capacity, sliding_window + max_query + 1)


def _check_sizes(context_limit: int, max_query: int) -> None:
    if context_limit < 1:
        raise ValueError('context_limit must be >= 1, got {}'.format(context_limit))
    if max_query < 1:
        raise ValueError('max_query must be >= 1, got {}'.format(max_query))


def _allocate(specs: list[KvLayerSpec], slots_of: dict[str, int], device: torch.device, dtype: torch.dtype):
    """Zeroed keys and values [kv_heads, slots, head_dim] per producing layer, slots_of[layer_type] slots each."""
    keys, values = [], []
    for spec in specs:
        shape = (spec.num_kv_heads, slots_of[spec.layer_type], spec.head_dim)
        keys.append(torch.zeros(shape, device=device, dtype=dtype))
        values.append(torch.zeros(shape, device=device, dtype=dtype))
    return keys, values


class StaticKvCache(SequenceLedger):
    """
    Preallocated K/V for one model at batch size 1.

    keys[i], values[i]: [kv_heads, slots, head_dim] for producing layer i (in ``specs`` order). ``length`` counts the
    tokens the cache holds (positions 0..length-1); writes past it are provisional until ``crop`` drops them.
    """

    def __init__(self, specs: list[KvLayerSpec], context_limit: int, sliding_window: int, max_query: int,
                 device: torch.device | str, dtype: torch.dtype):
        _check_sizes(context_limit, max_query)
        self.specs = list(specs)
        self.sliding_window = sliding_window
        self.max_query = max_query
        self.ring_size = _ring_size(context_limit, sliding_window, max_query)
        super().__init__(context_limit, self.ring_size - sliding_window - 1 if self.ring_size < context_limit
                         else context_limit)
        self.device = torch.device(device)
        self.dtype = dtype
        self.keys, self.values = _allocate(self.specs, {SLIDING: self.ring_size, FULL: context_limit}, self.device,
                                           dtype)
        self.ring_positions = torch.full((self.ring_size,), EMPTY_POSITION, device=self.device, dtype=torch.long)
        self.key_positions = torch.arange(context_limit, device=self.device)  # [context_limit] full-layer slots

    def tensors(self) -> list[torch.Tensor]:
        """Every buffer of the cache, in a fixed order (the same for two caches of one model)."""
        return [*self.keys, *self.values, self.ring_positions, self.key_positions]

    @property
    def nbytes(self) -> int:
        """Bytes held by the cache buffers."""
        return sum(tensor.numel() * tensor.element_size() for tensor in self.tensors())

    def reset(self) -> None:
        """Forget every token (a new request); the buffers are kept."""
        self.ring_positions.fill_(EMPTY_POSITION)
        self.forget()

    def write_slots(self, layer_type: str, positions: torch.Tensor) -> torch.Tensor:
        """Buffer slots [q] of positions [q] for a layer type."""
        return positions % self.ring_size if layer_type == SLIDING else positions


class KvSlot(SequenceLedger):
    """
    One sequence's slot of a SlottedKvCache, usable wherever a StaticKvCache is.

    Its tensors are views of the slotted buffers: the lean model's prefill and single-sequence step write and read
    it as their cache.
    """

    def __init__(self, owner: 'SlottedKvCache', index: int, max_rollback: int):
        super().__init__(owner.context_limit, max_rollback)
        self.index = index
        self.specs = owner.specs
        self.sliding_window = owner.sliding_window
        self.max_query = owner.max_query
        self.ring_size = owner.ring_size
        self.device, self.dtype = owner.device, owner.dtype
        self.keys = [owner.slot_of(spec.layer_type, tensor, index) for spec, tensor in zip(owner.specs, owner.keys,
                                                                                        strict=True)]
        self.values = [owner.slot_of(spec.layer_type, tensor, index) for spec, tensor in zip(owner.specs,
                                                                                          owner.values, strict=True)]
        self.ring_positions = owner.ring_positions[index * owner.ring_size:(index + 1) * owner.ring_size]
        self.key_positions = owner.key_positions

    def reset(self) -> None:
        """Forget every token (a new goal takes the slot)."""
        self.ring_positions.fill_(EMPTY_POSITION)
        self.forget()

    def write_slots(self, layer_type: str, positions: torch.Tensor) -> torch.Tensor:
        """Buffer slots [q] of positions [q] for a layer type, within this slot's views."""
        return positions % self.ring_size if layer_type == SLIDING else positions


class SlottedKvCache:
    """
    Preallocated K/V for up to ``num_slots`` sequences decoded together (continuous batching): one slot each.

    keys[i], values[i]: [kv_heads, num_slots * slot_len, head_dim]; slot s holds a full layer's position p at
    ``s * capacity + p`` and a sliding layer's at ``s * ring_size + p % ring_size``, so one index_copy writes every
    row of a batched step, which covers slots 0..B-1 (layers._slot_rows). ``slots[s]`` (a KvSlot) keeps slot s's
    length and rollback rules and serves as a single-sequence cache (prefill).

    A full layer holds ``context_limit + max_query`` positions per slot: a row padded to its batch's query length
    writes up to max_query - 1 positions past its own tokens (masked out, and overwritten later like rejected drafts).
    """

    def __init__(self, specs: list[KvLayerSpec], num_slots: int, context_limit: int, sliding_window: int,
                 max_query: int, device: torch.device | str, dtype: torch.dtype):
        _check_sizes(context_limit, max_query)
        if num_slots < 1:
            raise ValueError('num_slots must be >= 1, got {}'.format(num_slots))
        self.specs = list(specs)
        self.num_slots = num_slots
        self.context_limit = context_limit
        self.sliding_window = sliding_window
        self.max_query = max_query
        self.capacity = context_limit + max_query
        self.ring_size = _ring_size(self.capacity, sliding_window, max_query)
        self.device = torch.device(device)
        self.dtype = dtype
        self.keys, self.values = _allocate(self.specs, {SLIDING: num_slots * self.ring_size,
                                                        FULL: num_slots * self.capacity}, self.device, dtype)
        self.ring_positions = torch.full((num_slots * self.ring_size,), EMPTY_POSITION, device=self.device,
                                         dtype=torch.long)
        self.key_positions = torch.arange(self.capacity, device=self.device)  # [capacity] full-layer positions
        max_rollback = self.ring_size - sliding_window - 1 if self.ring_size < self.capacity else context_limit
        self.slots = [KvSlot(self, index, max_rollback) for index in range(num_slots)]

    def tensors(self) -> list[torch.Tensor]:
        """Every buffer of the cache, in a fixed order."""
        return [*self.keys, *self.values, self.ring_positions, self.key_positions]

    @property
    def nbytes(self) -> int:
        """Bytes held by the cache buffers (all slots)."""
        return sum(tensor.numel() * tensor.element_size() for tensor in self.tensors())

    @property
    def slot_nbytes(self) -> int:
        """Bytes one slot holds."""
        return self.nbytes // self.num_slots

    def slot_len(self, layer_type: str) -> int:
        """Buffer entries per slot of a layer type."""
        return self.ring_size if layer_type == SLIDING else self.capacity

    def slot_of(self, layer_type: str, tensor: torch.Tensor, index: int) -> torch.Tensor:
        """Slot index's part [kv_heads, slot_len, d] of a layer's keys or values (a view)."""
        per_slot = self.slot_len(layer_type)
        return tensor[:, index * per_slot:(index + 1) * per_slot]

    def ring_view(self, batch: int) -> torch.Tensor:
        """Ring positions [batch, ring_size] of slots 0..batch-1."""
        return self.ring_positions.view(self.num_slots, self.ring_size)[:batch]

    def write_slots(self, layer_type: str, positions: torch.Tensor) -> torch.Tensor:
        """Buffer indices [B * Q] of positions [B, Q], row b in slot b."""
        rows = torch.arange(positions.shape[0], device=positions.device)[:, None]
        per_slot = self.slot_len(layer_type)
        return (rows * per_slot + positions % per_slot).flatten()

"""
A KV prefix cache: the K/V of prompt prefixes kept across goals, in blocks keyed by token content (issue 52).

A planner sends the same long system prompt on every goal and only a short suffix changes. PrefixCache keeps the
K/V of every layer (full and sliding) of complete blocks of ``block_tokens`` prompt positions. A block's key chains
the hash of its parent block's key, its tokens and the images it holds (ImageKey: the image's run of tokens and a
digest of its pixels), so a block stands for the whole prefix up to its end. ``restore`` copies the longest cached
chain that prefixes a prompt into a fresh static cache (StaticKvCache or a batching slot's KvSlot): full layers
slot = position, sliding layers the ring of the last ``ring_size`` positions with its ring_positions, as a prefill
leaves them. ``store`` keeps the complete blocks of a prompt not yet cached; least-recently-used blocks without a
child go first when the budget is full, so a chain missing a block just ends there. Tokens are compared, not only
hashes.

Lossless: the prefill of a suffix after a restore gives the bits of a prefill of the whole prompt, because both go
through ``prefill`` here, which runs a prompt in chunks at fixed positions (multiples of ``chunk_tokens``, which
divides the block size; an image's run is never cut). A one-pass prefill differs in the last bits (its products
and attention run over other row counts and key layouts): the same prompt in one pass and in chunks gives logits a
few 1e-6 apart in float32. The chunks also let the sliding layers' K/V of every position be kept, each chunk's
read from the ring before the next chunk overwrites it (a chunk stretched over an image's run may outgrow the ring:
the blocks whose sliding K/V it lost are not kept, and the chain ends before them). The chunks cost no time: the
bundled target's 1,540-token prompt took 0.50 s in 64-token chunks against 0.77 s in one pass (1 thread).

Use one PrefixCache per model (the target's; a draft model's own): blocks hold that model's K/V, and only caches of
one sliding ring size use them (a chunk's sliding attention runs over the ring and the chunk, and another ring size
lays the keys out otherwise: other last bits). A model's single cache and its batching slots have one ring size
(window + max_query + 1). Not thread-safe.
"""

import hashlib
import struct
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ...types import ImageInput
from .cache import SLIDING, KvSlot, StaticKvCache
from .forward import LeanGemma4, StepOutput
from .vision import SoftTokens

DEFAULT_BLOCK_TOKENS = 64  # a Gemma 4 window (512, 1024) holds 8 or more; smaller windows prefill in smaller chunks


@dataclass(frozen=True)
class ImageKey:
    """One image of a prompt: its run of image tokens (positions start..start+length-1) and a digest of its pixels."""

    start: int
    length: int
    digest: bytes

    @property
    def end(self) -> int:
        """Return the position after the image's run."""
        return self.start + self.length


def image_digest(image: ImageInput) -> bytes:
    """Return a digest of an image's size and pixels (ImageKey.digest)."""
    digest = hashlib.blake2b(struct.pack('<QQ', image.width, image.height), digest_size=16)
    digest.update(image.rgb)
    return digest.digest()


def image_keys_of(token_ids: Sequence[int] | torch.Tensor, token_id: int,
                  digests: Sequence[bytes]) -> tuple[ImageKey, ...]:
    """Pair each run of token_id in a prompt with its image's digest, in order (one digest per image)."""
    runs = _runs(_token_list(token_ids), token_id)
    if len(runs) != len(digests):
        raise ValueError('the prompt holds {} runs of image token {} but {} digests were given'.format(
            len(runs), token_id, len(digests)))
    return tuple(ImageKey(start, length, bytes(digest)) for (start, length), digest in zip(runs, digests,
                                                                                           strict=True))


@dataclass(frozen=True)
class PrefixCacheStats:
    """What a prefix cache did and holds."""

    lookups: int          # restore calls
    hits: int             # of those, restores of at least one block
    tokens_reused: int    # prompt tokens restored instead of prefilled, all lookups together
    blocks: int           # blocks held
    nbytes: int           # bytes their K/V hold
    budget_bytes: int
    evictions: int        # blocks dropped for room

    @property
    def hit_rate(self) -> float:
        """Return hits per lookup (0 before the first lookup)."""
        return self.hits / self.lookups if self.lookups else 0.0


@dataclass(eq=False)
class _Block:
    """The K/V of block_tokens prompt positions, per producing layer [kv_heads, block_tokens, head_dim]."""

    key: bytes
    parent: bytes | None
    tokens: tuple[int, ...]
    images: tuple[ImageKey, ...]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    children: int = 0


class PrefixCache:
    """
    The K/V of prompt prefixes of one model, in blocks of block_tokens positions, within budget_bytes.

    ``prefill`` is the one call a runner makes per goal (runner.FastCausalLM.prefill_prompt, rows.FastRows
    .prefill_prompt); ``restore`` and ``store`` are its two halves. ``stats()`` for diagnostics.
    """

    def __init__(self, budget_bytes: int, block_tokens: int = DEFAULT_BLOCK_TOKENS):
        if budget_bytes < 0:
            raise ValueError('budget_bytes must be >= 0, got {}'.format(budget_bytes))
        if block_tokens < 1:
            raise ValueError('block_tokens must be >= 1, got {}'.format(block_tokens))
        self.budget_bytes = budget_bytes
        self.block_tokens = block_tokens
        self._blocks: OrderedDict[bytes, _Block] = OrderedDict()  # least recently used first
        self._layout = None      # (specs, dtype, device, ring_size) of the caches the blocks came from
        self._block_bytes = 0
        self._lookups = self._hits = self._tokens_reused = self._evictions = 0

    def stats(self) -> PrefixCacheStats:
        """Return the counters and what the cache holds."""
        return PrefixCacheStats(self._lookups, self._hits, self._tokens_reused, len(self._blocks),
                                len(self._blocks) * self._block_bytes, self.budget_bytes, self._evictions)

    def clear(self) -> None:
        """Drop every block (the counters stay); the cache may then serve another model."""
        self._blocks.clear()
        self._layout = None

    def chunk_tokens(self, sliding_window: int) -> int:
        """
        Return the prefill chunk of a model: the largest divisor of block_tokens of at most sliding_window + 1.

        Every position of a chunk is still in the sliding ring after its pass (the ring holds more than the
        window), where prefill reads its K/V for the blocks to store.
        """
        return max(size for size in range(1, min(self.block_tokens, sliding_window + 1) + 1)
                   if self.block_tokens % size == 0)

    def restore(self, tokens: Sequence[int] | torch.Tensor, cache: StaticKvCache | KvSlot,
                image_keys: Sequence[ImageKey] | None = None, min_suffix: int = 1) -> int:
        """
        Start a new sequence in cache with the longest cached prefix of tokens; return its length (0: a miss).

        cache: a StaticKvCache or a KvSlot of this cache's model; it is reset, then holds the restored positions
        (full layers, and the last ring_size positions in the sliding ring) and that length. A restore ends at a
        block boundary, leaves at least min_suffix tokens to prefill (the last position's logits come from a real
        pass) and never ends inside an image's run. image_keys: every image of an image goal (image_keys_of()).
        """
        tokens = _token_list(tokens)
        images = _checked_images(image_keys, len(tokens))
        cache.reset()
        self._lookups += 1
        chain: list[_Block] = []
        for key, part, held in self._keys(tokens, images, (len(tokens) - max(1, min_suffix)) // self.block_tokens):
            block = self._blocks.get(key)
            if block is None or not self._same(block, chain[-1].key if chain else None, part, held):
                break
            chain.append(block)
        while chain and _inside_image(len(chain) * self.block_tokens, images):
            chain.pop()
        if not chain:
            return 0
        self._check_layout(cache)
        length = len(chain) * self.block_tokens
        cache.check_write(0, length)
        self._copy_in(chain, cache)
        cache.advance(0, length)
        for block in chain:
            self._blocks.move_to_end(block.key)
        self._hits += 1
        self._tokens_reused += length
        return length

    def store(self, tokens: Sequence[int] | torch.Tensor, cache: StaticKvCache | KvSlot,
              image_keys: Sequence[ImageKey] | None = None) -> int:
        """
        Keep copies of the complete blocks of tokens (the prompt the cache holds) not yet cached; return how many.

        Reads full layers' K/V from the cache's slots and sliding layers' from its ring, which holds only the last
        ring_size positions: after a longer prompt prefilled elsewhere, the chain stored ends before the first block
        the ring lost. ``prefill`` keeps every block. Evicts least-recently-used leaves to stay within the budget.
        """
        tokens = _token_list(tokens)
        return self._store(tokens, cache, _checked_images(image_keys, len(tokens)), _KvReader(cache, 0, 0))

    @torch.inference_mode()
    def prefill(self, lean: LeanGemma4, cache: StaticKvCache | KvSlot, input_ids: torch.Tensor,
                logits_to_keep: int = 1, soft: SoftTokens | None = None,
                image_keys: Sequence[ImageKey] | None = None) -> tuple[StepOutput, int]:
        """
        Prefill a goal's prompt input_ids [1, n] into cache from position 0, reusing and keeping prefix blocks.

        Restores the longest cached prefix (restore), prefills the rest in chunks (chunk_tokens), stores the new
        complete blocks. Returns the output of the last logits_to_keep positions (1..n) and the tokens restored.
        soft: an image goal's soft tokens, whose runs image_keys must name, each with its digest.
        """
        tokens = _token_list(input_ids)
        if not 1 <= logits_to_keep <= len(tokens):
            raise ValueError('logits_to_keep must be 1..{} (the prompt length), got {}'.format(len(tokens),
                                                                                          logits_to_keep))
        images = _checked_images(image_keys, len(tokens))
        if soft is not None and [(key.start, key.length) for key in images] != _runs(tokens, soft.token_id):
            raise ValueError('image_keys must name each run of image token {} in the prompt (image_keys_of())'.format(
                soft.token_id))
        reused = self.restore(tokens, cache, images, logits_to_keep)
        complete = len(tokens) // self.block_tokens * self.block_tokens
        reader = _KvReader(cache, reused, complete)
        kept, first_kept, features = [], len(tokens) - logits_to_keep, []
        for start, end in _chunks(reused, len(tokens), self.chunk_tokens(cache.sliding_window), images):
            wanted = end - max(start, first_kept)  # of the positions kept, those in this chunk
            soft_part = _soft_slice(soft, tokens, start, end)
            out = lean.prefill(input_ids[:, start:end], cache, start, max(1, wanted), soft_part)
            if wanted > 0:
                kept.append(out)
            features += [] if out.features is None else [out.features]  # of the prefilled positions, not the reused
            reader.capture(start, end)
        self._store(tokens, cache, images, reader)
        if len(kept) == 1 and len(features) <= 1:  # one chunk: its output is the prompt's
            return kept[0], reused
        return StepOutput(torch.cat([out.logits for out in kept], dim=1),
                          torch.cat([out.hidden for out in kept], dim=1),
                          features=torch.cat(features, dim=1) if features else None), reused

    def _keys(self, tokens: list[int], images: tuple[ImageKey, ...], count: int):
        """Yield (key, tokens, images) of blocks 0..count-1 of a prompt; a key chains its parent's."""
        parent = b''
        size = self.block_tokens
        for index in range(count):
            start, end = index * size, (index + 1) * size
            part = tuple(tokens[start:end])
            held = tuple(image for image in images if image.start < end and image.end > start)
            parent = _block_key(parent, part, held)
            yield parent, part, held

    @staticmethod
    def _same(block: _Block, parent: bytes | None, tokens: tuple[int, ...], images: tuple[ImageKey, ...]) -> bool:
        """Whether a block found by its key holds these tokens and images after this parent (no hash collision)."""
        return block.parent == parent and block.tokens == tokens and block.images == images

    def _check_layout(self, cache) -> None:
        layout = (tuple(cache.specs), cache.dtype, torch.device(cache.device), cache.ring_size)
        if self._layout is None:
            self._layout = layout
            self._block_bytes = sum(2 * spec.num_kv_heads * self.block_tokens * spec.head_dim for spec in cache.specs
                                    ) * torch.empty((), dtype=cache.dtype).element_size()
        elif layout != self._layout:
            raise ValueError('this prefix cache holds the K/V of another model or cache geometry (layers, dtype, '
                             'device or sliding ring size differ): use one PrefixCache per model')

    def _copy_in(self, chain: list[_Block], cache) -> None:
        """Write the chain's K/V into a reset cache: full layers at their positions, the ring's last positions."""
        size, length = self.block_tokens, len(chain) * self.block_tokens
        first = max(0, length - cache.ring_size)  # the ring keeps positions first..length-1
        positions = torch.arange(first, length, device=cache.device)
        ring_slots = positions % cache.ring_size
        for index, spec in enumerate(cache.specs):
            for name in ('keys', 'values'):
                target = getattr(cache, name)[index]
                parts = [getattr(block, name)[index] for block in chain]
                if spec.layer_type == SLIDING:
                    recent = torch.cat(parts[first // size:], dim=1)[:, first % size:]
                    target.index_copy_(1, ring_slots, recent)
                else:
                    for number, part in enumerate(parts):
                        target[:, number * size:(number + 1) * size].copy_(part)
        cache.ring_positions.index_copy_(0, ring_slots, positions)

    def _store(self, tokens: list[int], cache, images: tuple[ImageKey, ...], reader: '_KvReader') -> int:
        count = min(len(tokens), cache.length) // self.block_tokens
        if count == 0 or self.budget_bytes == 0:
            return 0
        self._check_layout(cache)
        parent, added, pinned = None, 0, set()  # pinned: this prompt's chain, which no eviction may cut
        for index, (key, part, held) in enumerate(self._keys(tokens, images, count)):
            block = self._blocks.get(key)
            if block is not None:
                if not self._same(block, parent, part, held):
                    break  # a hash collision: the cached chain stays, this prompt's ends here
            else:
                start = index * self.block_tokens
                kv = reader.block(start, start + self.block_tokens)
                if kv is None or not self._make_room(pinned):
                    break
                block = self._blocks[key] = _Block(key, parent, part, held, *kv)
                if parent is not None:
                    self._blocks[parent].children += 1
                added += 1
            self._blocks.move_to_end(key)
            pinned.add(key)
            parent = key
        return added

    def _make_room(self, keep: set[bytes]) -> bool:
        """Evict least-recently-used blocks without children (none in keep) until one more fits in the budget."""
        while (len(self._blocks) + 1) * self._block_bytes > self.budget_bytes:
            victim = next((block for block in self._blocks.values() if block.children == 0 and block.key not in keep),
                          None)
            if victim is None:
                return False
            del self._blocks[victim.key]
            if victim.parent is not None:
                self._blocks[victim.parent].children -= 1
            self._evictions += 1
        return True


class _KvReader:
    """
    A block's K/V as a prefill leaves them in a cache.

    Full layers keep every position; sliding layers' K/V of positions staged_from..staged_to-1 are copied from the
    ring after each chunk (capture), other positions read from the ring while it still holds them.
    """

    def __init__(self, cache, staged_from: int, staged_to: int):
        self.cache = cache
        self.staged_from = staged_from
        self.captured = bytearray(max(0, staged_to - staged_from))  # 1: the position's sliding K/V are staged
        self.staged = {}  # kv index -> (keys, values) [kv_heads, staged_to - staged_from, head_dim]
        if self.captured:
            for index, spec in enumerate(cache.specs):
                if spec.layer_type == SLIDING:
                    shape = (spec.num_kv_heads, len(self.captured), spec.head_dim)
                    self.staged[index] = (torch.empty(shape, dtype=cache.dtype, device=cache.device),
                                          torch.empty(shape, dtype=cache.dtype, device=cache.device))

    def capture(self, start: int, end: int) -> None:
        """Stage the sliding K/V of a chunk just prefilled at positions start..end-1 (those the ring holds)."""
        low = max(start, end - self.cache.ring_size, self.staged_from)
        high = min(end, self.staged_from + len(self.captured))
        if low >= high:
            return
        slots = torch.arange(low, high, device=self.cache.device) % self.cache.ring_size
        for index, (keys, values) in self.staged.items():
            keys[:, low - self.staged_from:high - self.staged_from] = self.cache.keys[index].index_select(1, slots)
            values[:, low - self.staged_from:high - self.staged_from] = self.cache.values[index].index_select(1, slots)
        self.captured[low - self.staged_from:high - self.staged_from] = b'\x01' * (high - low)

    def block(self, start: int, end: int) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
        """Return copies of every layer's K/V of positions start..end-1 (None where a sliding layer's are lost)."""
        cache = self.cache
        low, high = start - self.staged_from, end - self.staged_from
        staged = low >= 0 and high <= len(self.captured) and all(self.captured[low:high])
        slots = torch.arange(start, end, device=cache.device) % cache.ring_size
        if not staged and not torch.equal(cache.ring_positions[slots], torch.arange(start, end, device=cache.device)):
            return None
        keys, values = [], []
        for index, spec in enumerate(cache.specs):
            if spec.layer_type != SLIDING:
                keys.append(cache.keys[index][:, start:end].clone())
                values.append(cache.values[index][:, start:end].clone())
            elif staged:
                keys.append(self.staged[index][0][:, low:high].clone())
                values.append(self.staged[index][1][:, low:high].clone())
            else:
                keys.append(cache.keys[index].index_select(1, slots))
                values.append(cache.values[index].index_select(1, slots))
        return keys, values


def _block_key(parent: bytes, tokens: tuple[int, ...], images: tuple[ImageKey, ...]) -> bytes:
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(array('q', tokens).tobytes())
    for image in images:
        digest.update(struct.pack('<qq', image.start, image.length))
        digest.update(image.digest)
    return digest.digest()


def _token_list(tokens: Sequence[int] | torch.Tensor) -> list[int]:
    """Return a prompt's token ids as a list (from a list, or a tensor [n] or [1, n])."""
    if isinstance(tokens, torch.Tensor):
        if tokens.dim() == 2 and tokens.shape[0] == 1:
            tokens = tokens[0]
        if tokens.dim() != 1:
            raise ValueError('a prompt is token ids [n] or [1, n], got shape {}'.format(tuple(tokens.shape)))
        return tokens.tolist()
    return list(tokens)


def _runs(tokens: list[int], token_id: int) -> list[tuple[int, int]]:
    """Return (start, length) of each run of token_id."""
    runs = []
    for position, token in enumerate(tokens):
        if token != token_id:
            continue
        if runs and runs[-1][0] + runs[-1][1] == position:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((position, 1))
    return runs


def _checked_images(image_keys: Sequence[ImageKey] | None, length: int) -> tuple[ImageKey, ...]:
    images = tuple(sorted(image_keys or (), key=lambda image: image.start))
    end = 0
    for image in images:
        if image.length < 1 or image.start < end or image.end > length:
            raise ValueError('image keys must be runs of at least one token inside the prompt of {} tokens, without '
                             'overlap; got {}'.format(length, image))
        end = image.end
    return images


def _inside_image(position: int, images: tuple[ImageKey, ...]) -> bool:
    """Whether a boundary before position would cut an image's run."""
    return any(image.start < position < image.end for image in images)


def _chunks(start: int, end: int, size: int, images: tuple[ImageKey, ...]) -> list[tuple[int, int]]:
    """Split positions start..end-1 at the multiples of size that cut no image's run."""
    bounds = [start] + [position for position in range(start - start % size + size, end, size)
                        if not _inside_image(position, images)] + [end]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def _soft_slice(soft: SoftTokens | None, tokens: list[int], start: int, end: int) -> SoftTokens | None:
    """Return the soft tokens of the image tokens at positions start..end-1 (None where it holds none)."""
    if soft is None:
        return None
    before = sum(1 for token in tokens[:start] if token == soft.token_id)
    inside = sum(1 for token in tokens[start:end] if token == soft.token_id)
    if inside == 0:
        return None
    return SoftTokens(soft.token_id, soft.features[before:before + inside], soft.seconds)

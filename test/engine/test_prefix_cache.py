"""
The KV prefix cache (runtime/model/prefix_cache.py) on tiny random Gemma 4 models.

A suffix prefilled after a restore must give the bits of a prefill of the whole prompt (logits, hidden states and
the greedy tokens after it), into a single cache or a batching slot; the sliding ring must be what a prefill leaves;
eviction keeps chains whole; an image's digest keys the blocks that hold it; a restore never takes the whole prompt.
"""

import pytest
import torch
from conftest import SLIDING_WINDOW, _text_config

from gemma_spec_ros.engine.runtime.model import prefix_cache as prefix_module
from gemma_spec_ros.engine.runtime.model.cache import EMPTY_POSITION, SLIDING
from gemma_spec_ros.engine.runtime.model.prefix_cache import PrefixCache, image_digest, image_keys_of
from gemma_spec_ros.engine.runtime.model.vision import SoftTokens
from gemma_spec_ros.engine.runtime.steps.rows import FastRows
from gemma_spec_ros.engine.runtime.steps.runner import FastCausalLM
from gemma_spec_ros.engine.types import ImageInput

CONTEXT = 384
MAX_QUERY = 9
VISION_MAX_QUERY = 24
BLOCK = 32            # twice the tiny models' window: prefill runs in chunks of 16 (PrefixCache.chunk_tokens)
BUDGET = 1 << 30
VOCAB = 512           # the vision model's (built here)
BOI, IMAGE, EOI = 509, 510, 511
S, F = 'sliding_attention', 'full_attention'


def _features_model(vocab: int):
    """Build a text model with the features E2B uses: per-layer inputs, KV sharing, k_eq_v, bias, softcapping."""
    from transformers import Gemma4ForCausalLM

    torch.manual_seed(2)
    text = _text_config(vocab, 64, [S, S, F, S, S, F], num_kv_shared_layers=3, final_logit_softcapping=5.0,
                        attention_k_eq_v=True, num_global_key_value_heads=1, attention_bias=True)
    text.hidden_size_per_layer_input, text.vocab_size_per_layer_input = 8, vocab
    return Gemma4ForCausalLM(text).eval()


def _vision_model():
    """Build a Gemma4ForConditionalGeneration whose image tokens see each other (no tower: soft tokens come given)."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    torch.manual_seed(3)
    text = _text_config(VOCAB, 64, [S, S, F, S, S, F], num_kv_shared_layers=3, use_bidirectional_attention='vision')
    text.hidden_size_per_layer_input, text.vocab_size_per_layer_input = 8, VOCAB
    config = Gemma4Config(text_config=text.to_dict(), vision_config=None, audio_config=None, image_token_id=IMAGE,
                          boi_token_id=BOI, eoi_token_id=EOI)
    return Gemma4ForConditionalGeneration(config).eval()


@pytest.fixture(scope='module')
def runners(tiny_models):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    loaded = {name: AutoModelForCausalLM.from_pretrained(getattr(tiny_models, name), dtype=torch.float32).eval()
              for name in ('target', 'draft')}
    loaded['features'] = _features_model(loaded['target'].config.vocab_size)
    loaded['vision'] = _vision_model()
    # the vision model's ring (window + max_query + 1) holds the 32-token chunk around its image (see below)
    return {name: FastCausalLM(model, CONTEXT, VISION_MAX_QUERY if name == 'vision' else MAX_QUERY, 'eager')
            for name, model in loaded.items()}


def _tokens(count: int, seed: int, vocab: int = 500) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (count,), generator=generator).tolist()


def _ids(tokens: list[int]) -> torch.Tensor:
    return torch.tensor([tokens])


def _greedy(runner: FastCausalLM, out, count: int) -> tuple[list[int], list[torch.Tensor]]:
    """Return the greedy tokens after a prefill, and the logits of each step."""
    tokens, logits = [], []
    token = out.logits[0, -1].argmax()
    for _ in range(count):
        tokens.append(int(token))
        step = runner.step(token.view(1, 1), 1)
        logits.append(step.logits.clone())
        token = step.logits[0, -1].argmax()
    return tokens, logits


def _cold(runner: FastCausalLM, tokens: list[int], **kwargs):
    """Prefill the whole prompt through a prefix cache that holds nothing."""
    out, reused = runner.prefill_prompt(_ids(tokens), PrefixCache(BUDGET, BLOCK), **kwargs)
    assert reused == 0
    return out


def _assert_same_output(actual, expected) -> None:
    assert torch.equal(actual.logits, expected.logits)
    assert torch.equal(actual.hidden, expected.hidden)


@pytest.mark.parametrize('name', ['target', 'draft', 'features'])
def test_a_hit_prefills_the_suffix_to_the_bits_of_a_full_prefill(runners, name):
    runner = runners[name]
    system = _tokens(150, 1)  # more than nine windows
    first, second = system + _tokens(23, 2), system + _tokens(23, 3)
    cache = PrefixCache(BUDGET, BLOCK)
    assert runner.prefill_prompt(_ids(first), cache)[1] == 0
    out, reused = runner.prefill_prompt(_ids(second), cache)
    assert reused == 128  # the system prompt's complete blocks
    greedy = _greedy(runner, out, 6)

    cold = _cold(runner, second)
    _assert_same_output(out, cold)
    cold_greedy = _greedy(runner, cold, 6)
    assert greedy[0] == cold_greedy[0]
    assert all(torch.equal(hit, full) for hit, full in zip(greedy[1], cold_greedy[1], strict=True))

    stats = cache.stats()
    assert (stats.lookups, stats.hits, stats.tokens_reused) == (2, 1, 128)
    assert stats.blocks == 5 + 1  # the first prompt's 5, the second's 6th (its first 4 were cached)
    assert stats.nbytes > 0 and stats.nbytes % stats.blocks == 0 and stats.hit_rate == 0.5

    # a one-pass prefill (no prefix cache) runs other row counts: the same to rounding, not always to the bit
    plain, reused = runner.prefill_prompt(_ids(second))
    assert reused == 0
    assert torch.allclose(plain.logits, cold.logits, atol=1e-4, rtol=0)


def _cache_state(cache, length: int) -> list[torch.Tensor]:
    """Return what the next pass reads of a cache of length tokens: full layers' slots, the ring's live slots."""
    live = cache.ring_positions != EMPTY_POSITION
    state = [cache.ring_positions.clone()]
    for index, spec in enumerate(cache.specs):
        for tensors in (cache.keys, cache.values):
            state.append(tensors[index][:, live] if spec.layer_type == SLIDING else tensors[index][:, :length])
    return state


@pytest.mark.parametrize('max_query', [MAX_QUERY, 40], ids=['ring shorter than a block', 'ring longer than a block'])
def test_a_restored_ring_is_the_ring_a_prefill_leaves(runners, max_query):
    lean, tokens = runners['features'].lean, _tokens(200, 4)
    cache = PrefixCache(BUDGET, BLOCK)
    cache.prefill(lean, lean.new_cache(CONTEXT, max_query), _ids(tokens))
    for length in (32, 160):  # one block, and many windows
        restored = lean.new_cache(CONTEXT, max_query)
        assert cache.restore(tokens[:length + 1], restored) == length
        assert restored.length == length
        positions = sorted(p for p in restored.ring_positions.tolist() if p != EMPTY_POSITION)
        assert positions == list(range(max(0, length - restored.ring_size), length))

        prefilled = lean.new_cache(CONTEXT, max_query)
        cache.prefill(lean, prefilled, _ids(tokens[:length]))  # a hit up to length - 32, then a prefill
        cold = lean.new_cache(CONTEXT, max_query)
        PrefixCache(BUDGET, BLOCK).prefill(lean, cold, _ids(tokens[:length]))
        for state in (_cache_state(prefilled, length), _cache_state(restored, length)):
            assert all(torch.equal(a, b) for a, b in zip(state, _cache_state(cold, length), strict=True))
    # the K/V of a chunk depend on how the ring lays out its keys: another ring size is refused
    with pytest.raises(ValueError, match='ring size'):
        cache.restore(tokens, lean.new_cache(CONTEXT, max_query + 1))


def test_a_batching_slot_restores_as_a_single_cache_does(runners):
    runner = runners['target']
    rows = FastRows(runner.lean, 'eager', 3, CONTEXT, MAX_QUERY)
    system = _tokens(100, 5)
    cache = PrefixCache(BUDGET, BLOCK)
    runner.prefill_prompt(_ids(system + _tokens(9, 6)), cache)
    rows.prefill_prompt(2, _ids(_tokens(80, 7)), cache)  # the slot held another goal before
    prompt = system + _tokens(17, 8)
    out, reused = rows.prefill_prompt(2, _ids(prompt), cache)
    assert reused == 96
    cold = _cold(runner, prompt)
    _assert_same_output(out, cold)
    slot = rows.cache.slots[2]
    assert slot.length == len(prompt)
    assert all(torch.equal(a, b) for a, b in zip(_cache_state(slot, len(prompt)),
                                                 _cache_state(runner.cache, len(prompt)), strict=True))
    assert all(not (other.ring_positions != EMPTY_POSITION).any() for other in rows.cache.slots[:2])
    # a batched step reads the restored slot as the single-goal step reads its cache
    token = int(out.logits[0, -1].argmax())
    batched = rows.step(torch.tensor([[0], [0], [token]]), [0, 0, len(prompt)])
    single = runner.step(torch.tensor([[token]]), 1)
    assert torch.allclose(batched.logits[2, -1], single.logits[0, -1], atol=1e-4, rtol=0)


def _chains_whole(cache: PrefixCache) -> bool:
    held = cache._blocks
    return all(block.parent is None or block.parent in held for block in held.values()) and all(
        block.children == sum(1 for other in held.values() if other.parent == block.key) for block in held.values())


def test_eviction_drops_least_recently_used_leaves_within_a_tiny_budget(runners):
    runner = runners['target']
    first, second = _tokens(100, 9), _tokens(100, 10)  # 3 complete blocks each
    sizing = PrefixCache(BUDGET, BLOCK)
    runner.prefill_prompt(_ids(first), sizing)
    block_bytes = sizing.stats().nbytes // sizing.stats().blocks

    cache = PrefixCache(4 * block_bytes, BLOCK)
    runner.prefill_prompt(_ids(first), cache)
    runner.prefill_prompt(_ids(second), cache)  # room for one more: the first prompt's last two blocks go
    stats = cache.stats()
    assert (stats.blocks, stats.evictions, stats.nbytes) == (4, 2, 4 * block_bytes)
    assert _chains_whole(cache)
    assert cache.restore(second + [1], runner.cache) == 96
    out, reused = runner.prefill_prompt(_ids(first), cache)  # its chain ends at the missing block
    assert reused == 32
    _assert_same_output(out, _cold(runner, first))
    assert cache.stats().nbytes <= cache.budget_bytes and _chains_whole(cache)
    assert cache.restore(first + [1], runner.cache) == 96  # stored again, the second prompt's leaves evicted
    assert cache.restore(second + [1], runner.cache) < 96

    tiny = PrefixCache(block_bytes - 1, BLOCK)  # not one block fits
    runner.prefill_prompt(_ids(first), tiny)
    assert tiny.stats().blocks == 0 and tiny.restore(first, runner.cache) == 0
    with pytest.raises(ValueError, match='another model'):
        cache.restore(first + [1], runners['draft'].cache)


def _image_prompt(before: list[int], image_tokens: int, after: list[int]) -> list[int]:
    return before + [BOI] + [IMAGE] * image_tokens + [EOI] + after


def _picture(seed: int) -> tuple[ImageInput, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (4, 5, 3), dtype=torch.uint8, generator=generator)
    return ImageInput(5, 4, pixels.numpy().tobytes()), torch.randn(20, 64, generator=generator)


def test_an_image_digest_keys_the_blocks_that_hold_the_image(runners):
    runner = runners['vision']
    first, second = _picture(0), _picture(1)
    assert image_digest(first[0]) != image_digest(second[0])
    head, common = _tokens(40, 11), _tokens(50, 12)  # the image's run: positions 41..60, across 48
    prompt = _image_prompt(head, 20, common + _tokens(20, 13))
    other_prompt = _image_prompt(head, 20, common + _tokens(20, 14))

    def goal(tokens, picture, cache):
        keys = image_keys_of(tokens, IMAGE, [image_digest(picture[0])])
        assert [(key.start, key.length) for key in keys] == [(41, 20)]
        return runner.prefill_prompt(_ids(tokens), cache, soft=SoftTokens(IMAGE, picture[1], 0.0), image_keys=keys)

    cache = PrefixCache(BUDGET, BLOCK // 2)
    assert goal(prompt, first, cache)[1] == 0
    out, reused = goal(other_prompt, first, cache)  # the same image: reused past it
    assert reused == 112
    _assert_same_output(out, goal(other_prompt, first, PrefixCache(BUDGET, BLOCK // 2))[0])
    out, reused = goal(other_prompt, second, cache)  # another image: a miss at the block where it starts
    assert reused == 32
    _assert_same_output(out, goal(other_prompt, second, PrefixCache(BUDGET, BLOCK // 2))[0])
    # a restore never ends inside an image's run: up to 48 would cut it
    short = prompt[:62]
    assert cache.restore(short, runner.cache, image_keys_of(short, IMAGE, [image_digest(first[0])])) == 32

    # a ring shorter than the chunk around the image loses part of its sliding K/V: the chain ends before it
    lean, small_ring = runner.lean, runner.lean.new_cache(CONTEXT, MAX_QUERY)
    cache = PrefixCache(BUDGET, BLOCK // 2)
    keys = image_keys_of(prompt, IMAGE, [image_digest(first[0])])
    cache.prefill(lean, small_ring, _ids(prompt), soft=SoftTokens(IMAGE, first[1], 0.0), image_keys=keys)
    assert cache.stats().blocks == 2
    with pytest.raises(ValueError, match='image_keys'):
        runner.prefill_prompt(_ids(prompt), cache, soft=SoftTokens(IMAGE, first[1], 0.0))
    with pytest.raises(ValueError, match='2 digests'):
        image_keys_of(prompt, IMAGE, [b'a', b'b'])


def test_a_restore_never_takes_the_whole_prompt(runners):
    runner = runners['target']
    tokens = _tokens(64, 14)  # two complete blocks
    cache = PrefixCache(BUDGET, BLOCK)
    cold, _ = runner.prefill_prompt(_ids(tokens), cache)
    out, reused = runner.prefill_prompt(_ids(tokens), cache)
    assert reused == 32
    _assert_same_output(out, cold)
    assert runner.prefill_prompt(_ids(tokens + [7]), cache)[1] == 64
    # logits kept across chunks: the restore leaves them all to prefill
    longer = tokens + _tokens(40, 19)
    for keep, restored in ((40, 64), (41, 32)):
        kept, reused = runner.prefill_prompt(_ids(longer), cache, logits_to_keep=keep)
        assert reused == restored and kept.logits.shape[1] == keep
        _assert_same_output(kept, _cold(runner, longer, logits_to_keep=keep))
    assert cache.restore(tokens[:32], runner.cache) == 0 and runner.cache.length == 0


def test_tokens_are_compared_not_only_hashes(runners, monkeypatch):
    runner = runners['target']
    monkeypatch.setattr(prefix_module, '_block_key', lambda parent, tokens, images: b'every block collides')
    first, second = _tokens(40, 15), _tokens(40, 16)
    cache = PrefixCache(BUDGET, BLOCK)
    runner.prefill_prompt(_ids(first), cache)
    out, reused = runner.prefill_prompt(_ids(second), cache)
    assert reused == 0
    _assert_same_output(out, _cold(runner, second))
    assert cache.restore(first, runner.cache) == 32  # the first prompt's block stays


def test_the_chunk_fits_the_window(runners):
    assert SLIDING_WINDOW == 16
    assert PrefixCache(BUDGET).chunk_tokens(SLIDING_WINDOW) == 16    # the default block (64) in chunks of 16
    assert PrefixCache(BUDGET).chunk_tokens(512) == 64
    assert PrefixCache(BUDGET, 48).chunk_tokens(SLIDING_WINDOW) == 16
    assert PrefixCache(BUDGET, 20).chunk_tokens(SLIDING_WINDOW) == 10
    runner = runners['target']
    tokens = _tokens(150, 17)
    cache = PrefixCache(BUDGET)  # the default block size works with a 16-token window
    runner.prefill_prompt(_ids(tokens), cache)
    out, reused = runner.prefill_prompt(_ids(tokens[:140] + _tokens(5, 18)), cache)
    assert reused == 128
    cold, _ = runner.prefill_prompt(_ids(tokens[:140] + _tokens(5, 18)), PrefixCache(BUDGET))
    _assert_same_output(out, cold)

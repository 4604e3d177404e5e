"""The fast path (engine/fast): lean forward + static cache against transformers' Gemma 4, on tiny random models."""

import gc
import os
import random
import re
import weakref

import pytest
import torch

from gemma_spec_ros.engine.logits.verify import verify
from gemma_spec_ros.engine.runtime.model import forward as fast_model
from gemma_spec_ros.engine.runtime.model import layers, weights
from gemma_spec_ros.engine.runtime.model.cache import StaticKvCache
from gemma_spec_ros.engine.runtime.ops import cpu_ops
from gemma_spec_ros.engine.runtime.ops.compile_cache import compile_cache_dir
from gemma_spec_ros.engine.runtime.steps.assistant import GREEDY_STEPS, FastAssistant
from gemma_spec_ros.engine.runtime.steps.direct_graph import _DirectGraph
from gemma_spec_ros.engine.runtime.steps.runner import FastCausalLM
from gemma_spec_ros.engine.runtime.steps.tables import _Steps, query_variant, resolve_compile_mode, stores_blocked

WINDOW = 8
MAX_QUERY = 9          # K_max + 1 with K_max = 8
CONTEXT = 256
ATOL = 1e-4
SLIDING, FULL = 'sliding_attention', 'full_attention'
VOCAB = 512


def _text_config(**extra):
    from transformers import Gemma4TextConfig

    settings = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        layer_types=[SLIDING, FULL, SLIDING, FULL], num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        global_head_dim=32, sliding_window=WINDOW, hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
        max_position_embeddings=1024, initializer_range=0.2, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    settings.update(extra)
    return Gemma4TextConfig(**settings)


# every feature real Gemma 4 checkpoints use, in one text config: per-layer embeddings, KV sharing (the last
# three layers reuse K/V), attention_k_eq_v with its own KV-head count on full layers, attention bias, final logit
# softcapping, and proportional rope with partial rotary on full layers (the config default)
FEATURES = dict(
    num_hidden_layers=6, layer_types=[SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL], num_kv_shared_layers=3,
    hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB, attention_k_eq_v=True,
    num_global_key_value_heads=1, attention_bias=True, final_logit_softcapping=5.0)


def _build(kind: str):
    from transformers import Gemma4Config, Gemma4ForCausalLM, Gemma4ForConditionalGeneration

    torch.manual_seed({'plain': 1, 'features': 2, 'multimodal': 3}[kind])
    if kind == 'plain':
        return Gemma4ForCausalLM(_text_config()).eval()
    if kind == 'features':
        return Gemma4ForCausalLM(_text_config(**FEATURES)).eval()
    text = _text_config(**{**FEATURES, 'attention_k_eq_v': False, 'attention_bias': False})
    return Gemma4ForConditionalGeneration(Gemma4Config(text_config=text.to_dict(), vision_config=None,
                                                       audio_config=None)).eval()


@pytest.fixture(scope='module')
def models():
    torch.set_num_threads(1)
    return {kind: _build(kind) for kind in ('plain', 'features', 'multimodal')}


def _assistant(target, ordered: bool):
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM

    text = target.config.get_text_config()
    torch.manual_seed(5)
    config = Gemma4AssistantConfig(
        text_config=_text_config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 layer_types=[SLIDING, FULL], num_key_value_heads=text.num_key_value_heads),
        backbone_hidden_size=text.hidden_size, use_ordered_embeddings=ordered, num_centroids=16,
        centroid_intermediate_top_k=4)
    assistant = Gemma4AssistantForCausalLM(config).eval()
    if ordered:
        assistant.masked_embedding.token_ordering.copy_(torch.randperm(VOCAB))
    return assistant


class Reference:
    """transformers' forward on a DynamicCache, driven the way the engine drives it."""

    def __init__(self, model):
        from transformers import DynamicCache

        self.model = model
        self.cache = DynamicCache(config=model.config)
        self.cache.activate_past_recording()
        self.length = 0

    @torch.inference_mode()
    def forward(self, ids: list[int]):
        token_ids = torch.tensor([ids])
        positions = torch.arange(self.length, self.length + len(ids))[None]
        out = self.model(input_ids=token_ids, position_ids=positions, cache=self.cache, use_cache=True,
                         output_hidden_states=-1, return_shared_kv_states=True)
        self.length += len(ids)
        return out

    def crop(self, count: int) -> None:
        self.cache.crop(-count)
        self.length -= count


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape
    assert (actual - expected).abs().max().item() < ATOL


@pytest.mark.parametrize('kind', ['plain', 'features', 'multimodal'])
def test_verify_steps_and_rollbacks_match_transformers(models, kind):
    """Prefill, then rounds of q = 1..9 (and 19) tokens with random rollbacks, crossing the sliding window 20+ times."""
    model = models[kind]
    fast = FastCausalLM(model, CONTEXT, MAX_QUERY, 'eager')
    reference = Reference(model)
    rng = random.Random(kind)
    prompt = [rng.randrange(3, VOCAB) for _ in range(WINDOW + 5)]
    expected = reference.forward(prompt)
    out = fast.prefill(torch.tensor([prompt]))
    _close(out.logits, expected.logits[:, -1:])
    _close(out.hidden, expected.hidden_states[-1][:, -1:])
    rounds = 0
    while fast.length < 200:
        # every 10th round appends more than a step takes, through prefill (a drafter catching up after plain rounds)
        q = 2 * WINDOW + 3 if rounds % 10 == 5 else rounds % MAX_QUERY + 1
        ids = [rng.randrange(3, VOCAB) for _ in range(q)]
        expected = reference.forward(ids)
        out = fast.append(torch.tensor([ids]), 0)
        _close(out.logits, expected.logits)
        _close(out.hidden, expected.hidden_states[-1])
        rejected = rng.randrange(min(q, MAX_QUERY))  # a verify pass keeps its first token; slack is max_query
        fast.crop(-rejected)
        reference.crop(rejected)
        rounds += 1
    assert rounds > 40


def test_verify_pass_carries_the_greedy_verdict_on_its_drafts(models):
    """A verify pass of q tokens returns verify()'s greedy verdict on its q - 1 drafts: accepted count, next token."""
    fast = FastCausalLM(models['plain'], CONTEXT, MAX_QUERY, 'eager')
    fast.prefill(torch.tensor([[2, *range(10, 30)]]))
    token = torch.tensor([[7]])
    for q in range(1, MAX_QUERY + 1):
        greedy = []  # the target's own greedy continuation of token
        for _ in range(q):
            greedy.append(fast.step(torch.tensor([[token.item(), *greedy]])).logits[0, -1].argmax().item())
            fast.crop(-len(greedy))
        for matching in range(q):  # drafts: the first `matching` follow the target, then one it would not pick
            drafts = greedy[:matching] + [(greedy[matching] + 1) % VOCAB] * (q - 1 - matching)
            out = fast.step(torch.tensor([[token.item(), *drafts]]))
            num_accepted, next_token = verify(torch.tensor([drafts], dtype=torch.long), out.logits, None, greedy=True)
            expected_accepted = min(matching, q - 1)
            assert num_accepted.item() == expected_accepted
            assert out.greedy_row.tolist() == [expected_accepted, *drafts, -1, next_token.item()]
            assert next_token.item() == greedy[expected_accepted]
            fast.crop(-q)
        fast.step(token)  # the next pass starts at the target's pick
        token = torch.tensor([[greedy[0]]])


@pytest.mark.parametrize('kind', ['plain', 'features'])
def test_rollback_at_the_window_edge(models, kind):
    """Rollbacks that land where the sliding window fills, on a ring wrap, and the largest one allowed."""
    model = models[kind]
    fast = FastCausalLM(model, CONTEXT, MAX_QUERY, 'eager')
    reference = Reference(model)
    rng = random.Random(7)
    ring = fast.cache.ring_size

    def round_trip(q: int, rejected: int) -> None:
        ids = [rng.randrange(3, VOCAB) for _ in range(q)]
        expected = reference.forward(ids)
        _close(fast.step(torch.tensor([ids])).logits, expected.logits)
        fast.crop(-rejected)
        reference.crop(rejected)

    reference.forward([5, 6])
    fast.prefill(torch.tensor([[5, 6]]))
    round_trip(MAX_QUERY, MAX_QUERY - (WINDOW - 2))    # back to exactly WINDOW tokens: the window just filled
    assert fast.length == WINDOW
    round_trip(MAX_QUERY, MAX_QUERY - 1)                # WINDOW + 1
    round_trip(MAX_QUERY, MAX_QUERY)                    # the largest rollback: nothing kept
    assert fast.length == WINDOW + 1
    while fast.length + MAX_QUERY < 2 * ring:
        round_trip(MAX_QUERY, MAX_QUERY - 2)
    target = 2 * ring - fast.length                     # land exactly on a ring wrap (length = 2 * ring)
    round_trip(MAX_QUERY, MAX_QUERY - target)
    assert fast.length == 2 * ring
    for q in range(1, MAX_QUERY + 1):
        round_trip(q, q - 1 if q > 1 else 0)
    fast.step(torch.tensor([[7] * MAX_QUERY]))
    fast.step(torch.tensor([[7]]))
    with pytest.raises(ValueError, match='slack'):  # sliding K/V still needed was overwritten
        fast.crop(-(MAX_QUERY + 1))


def _greedy_reference(model, prompt: list[int], new_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize('kind', ['plain', 'features', 'multimodal'])
def test_greedy_decoding_matches_generate(models, kind):
    """Plain greedy decoding and a speculative loop with partly wrong drafts give generate's tokens exactly."""
    model = models[kind]
    prompt = [2, *random.Random(3).sample(range(3, VOCAB), 11)]
    expected = _greedy_reference(model, prompt, 80)

    fast = FastCausalLM(model, CONTEXT, MAX_QUERY, 'eager')
    token = fast.prefill(torch.tensor([prompt])).logits[0, -1].argmax()
    plain = [token.item()]
    while len(plain) < len(expected):
        token = fast.step(token.view(1, 1)).logits[0, -1].argmax()
        plain.append(token.item())
    assert plain == expected

    fast.reset()
    rng = random.Random(11)
    generated = [fast.prefill(torch.tensor([prompt])).logits[0, -1].argmax().item()]
    while len(generated) < len(expected):
        k = rng.randrange(1, MAX_QUERY)
        drafts = list(expected[len(generated):len(generated) + k])
        if drafts and rng.random() < 0.7:  # corrupt one draft, so that some rounds reject
            drafts[rng.randrange(len(drafts))] = rng.randrange(3, VOCAB)
        picks = fast.step(torch.tensor([[generated[-1], *drafts]])).logits[0].argmax(-1).tolist()
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == picks[accepted]:
            accepted += 1
        fast.crop(-(len(drafts) - accepted))
        generated += drafts[:accepted] + [picks[accepted]]
    assert generated[:len(expected)] == expected


@pytest.mark.parametrize('kind, ordered', [('plain', False), ('plain', True), ('multimodal', False)])
def test_assistant_matches_transformers(models, kind, ordered):
    """The MTP step reading the static cache equals transformers' assistant handed the target's shared K/V."""
    target = models[kind]
    assistant = _assistant(target, ordered)
    fast = FastCausalLM(target, CONTEXT, MAX_QUERY, 'eager')
    fast_assistant = FastAssistant(assistant, fast, 'eager')
    reference = Reference(target)
    rng = random.Random(13)
    embed = target.get_input_embeddings()

    def compare(out, num_kept: int, token: int) -> None:
        hidden = out.hidden_states[-1][:, num_kept - 1:num_kept]
        drop = out.hidden_states[-1].shape[1] - num_kept
        shared = {kind: (keys[..., :keys.shape[-2] - drop, :], values[..., :values.shape[-2] - drop, :])
                  for kind, (keys, values) in out.shared_kv_states.items()}
        fast_hidden = hidden
        ids = torch.tensor([[token]])
        for _ in range(3):
            with torch.inference_mode():
                expected = assistant(inputs_embeds=torch.cat([embed(ids), hidden], -1),
                                     position_ids=torch.tensor([[fast.length]]), shared_kv_states=shared)
            actual = fast_assistant.step(ids, fast_hidden, fast.length)
            _close(actual.logits, expected.logits)
            _close(actual.hidden, expected.last_hidden_state)
            ids = expected.logits[:, -1:].argmax(-1)
            hidden, fast_hidden = expected.last_hidden_state, actual.hidden

    prompt = [rng.randrange(3, VOCAB) for _ in range(3 * WINDOW)]
    out = reference.forward(prompt)
    fast.prefill(torch.tensor([prompt]))
    compare(out, len(prompt), rng.randrange(3, VOCAB))
    for _ in range(12):  # rounds that accept at least one draft hand over window + 1 sliding positions
        q = rng.randrange(2, MAX_QUERY + 1)
        ids = [rng.randrange(3, VOCAB) for _ in range(q)]
        out = reference.forward(ids)
        fast.step(torch.tensor([ids]))
        accepted = rng.randrange(1, q)
        fast.crop(-(q - 1 - accepted))
        reference.crop(q - 1 - accepted)
        compare(out, accepted + 1, rng.randrange(3, VOCAB))


def test_cache_memory_and_limits(models):
    fast = FastCausalLM(models['features'], CONTEXT, MAX_QUERY, 'eager')
    cache = fast.cache
    # features: producing layers S, S, F (the last three reuse them); sliding rings hold window + max_query + 1
    assert [spec.layer_type for spec in cache.specs] == [SLIDING, SLIDING, FULL]
    assert cache.ring_size == WINDOW + MAX_QUERY + 1
    elements = 2 * (2 * 2 * cache.ring_size * 16 + 1 * CONTEXT * 32)  # K and V: kv heads x slots x head_dim
    assert cache.nbytes == elements * 4 + (cache.ring_size + CONTEXT) * 8
    fast.prefill(torch.tensor([[3] * (CONTEXT - 2)]))
    with pytest.raises(ValueError, match='context_limit'):
        fast.step(torch.tensor([[3] * 3]))
    with pytest.raises(ValueError, match='max_query'):
        fast.step(torch.tensor([[3] * (MAX_QUERY + 1)]))
    with pytest.raises(ValueError, match='negative'):
        fast.crop(2)
    with pytest.raises(ValueError, match='context_limit'):
        StaticKvCache(cache.specs, 0, WINDOW, MAX_QUERY, 'cpu', torch.float32)


def _inside(tensor: torch.Tensor, buffers: list[torch.Tensor]) -> bool:
    start = tensor.data_ptr()
    return any(buffer.data_ptr() <= start and start + tensor.numel() * tensor.element_size() <= buffer.data_ptr()
               + buffer.numel() * buffer.element_size() for buffer in buffers)


@pytest.mark.parametrize('kind', ['features', 'multimodal'])
def test_lean_weights_live_in_one_flat_buffer_per_dtype(kind):
    """The model's parameters are moved into the lean forward's buffers (shared, not copied), a tied weight once."""
    model = _build(kind)
    before = {name: parameter.detach().clone() for name, parameter in model.named_parameters()}
    fast = FastCausalLM(model, CONTEXT, MAX_QUERY, 'eager')
    buffers = fast.lean.tensors.buffers
    assert [buffer.dtype for buffer in buffers] == [torch.float32]
    read = [parameter for name, parameter in model.named_parameters() if 'layers.' in name or 'embed' in name]
    assert read and all(_inside(parameter, buffers) for parameter in read)
    assert fast.lean.embed is fast.lean.lm_head  # tied: stored once
    every = sum(tensor.numel() for tensor in [*model.parameters(), *model.buffers()])
    assert buffers[0].numel() < every + fast_model.FlatTensors.ALIGN * 400  # nothing copied twice
    assert all(torch.equal(parameter, before[name]) for name, parameter in model.named_parameters())
    ids = torch.tensor([[2, 11, 12, 13]])
    with torch.no_grad():  # the transformers model still runs on the moved parameters
        _close(fast.prefill(ids).logits, model(ids).logits[:, -1:])


def test_compile_modes():
    with pytest.raises(ValueError, match='engine.compile'):
        resolve_compile_mode('fast', torch.device('cpu'))
    with pytest.raises(ValueError, match='CUDA'):
        resolve_compile_mode('cudagraph', torch.device('cpu'))
    assert resolve_compile_mode('auto', torch.device('cuda')) == 'cudagraph'
    assert resolve_compile_mode('eager', torch.device('cpu')) == 'eager'
    with pytest.raises(ValueError, match='inductor-gemm is for CPU'):
        resolve_compile_mode('inductor-gemm', torch.device('cuda'))


@pytest.mark.skipif(os.environ.get('GEMMA_SPEC_COMPILE_TESTS') != '1',
                    reason='inductor compiles take minutes on a shared CPU: set GEMMA_SPEC_COMPILE_TESTS=1')
@pytest.mark.parametrize('inline', [True, False], ids=['layers inlined, C++ wrapper', 'a region per layer shape'])
def test_inductor_steps_match_eager_without_recompiling(monkeypatch, inline):
    """A graph per query variant serves its query lengths at every position; the assistant's serves every position."""
    if not inline:  # the path of models deeper than INLINE_MAX_LAYERS
        monkeypatch.setattr(fast_model, 'INLINE_MAX_LAYERS', 0)
    model = _build('plain')  # not the fixture: other tests moved its weights into flat buffers, which regions refuse
    assistant = _assistant(model, ordered=True)  # load every model first: that can register new pytree types,
    eager = FastCausalLM(model, CONTEXT, MAX_QUERY, 'eager')  # which compiled graphs guard on
    compiled = FastCausalLM(model, CONTEXT, MAX_QUERY, 'inductor')
    report = compiled.warmup()
    variants = {query_variant(q) for q in range(1, MAX_QUERY + 1)}  # each q of row products[, the rest]
    assert (report.mode, report.graphs) == ('inductor', len(variants))
    assert report.direct_graphs == report.graphs  # each runs without dynamo's entry from its first rerun on
    eager_assistant, compiled_assistant = FastAssistant(assistant, eager, 'eager'), FastAssistant(assistant, eager,
                                                                                                  'inductor')
    assistant_report = compiled_assistant.warmup()
    assert assistant_report.graphs == assistant_report.direct_graphs == 1 + len(GREEDY_STEPS)  # step, greedy steps
    prompt = torch.tensor([[2, *range(10, 30)]])
    hidden = eager.prefill(prompt).hidden
    compiled.prefill(prompt)
    token = torch.tensor([[7]])
    with torch.compiler.set_stance('fail_on_recompile'):
        for q in [1, 3, 9, 2] * 6:  # crosses the sliding window several times
            expected, actual = eager_assistant.step(token, hidden, eager.length), compiled_assistant.step(
                token, hidden, eager.length)
            _close(actual.logits, expected.logits)
            _close(actual.hidden, expected.hidden)
            compiled_assistant.greedy_drafts(token, hidden, eager.length, 7)  # every greedy step function
            expected = _verify_pass_matches(eager, compiled, token, q)
            token, hidden = expected.logits[:, :1].argmax(-1), expected.hidden[:, :1]


def _verify_pass_matches(eager: FastCausalLM, compiled: FastCausalLM, token: torch.Tensor, q: int):
    """Run a pass of token + q - 1 drafts on both, compare, keep only token (a rollback); return eager's output."""
    ids = torch.cat([token, torch.arange(40, 40 + q - 1)[None]], dim=1)
    expected, actual = eager.step(ids), compiled.step(ids)
    _close(actual.logits, expected.logits)
    _close(actual.hidden, expected.hidden)
    assert torch.equal(actual.greedy_row, expected.greedy_row)  # verify() inside the graph
    eager.crop(-(q - 1))
    compiled.crop(-(q - 1))
    return expected


@pytest.mark.skipif(os.environ.get('GEMMA_SPEC_COMPILE_TESTS') != '1',
                    reason='a compile on frozen weights takes a minute on a shared CPU: set GEMMA_SPEC_COMPILE_TESTS=1')
def test_inductor_gemm_verify_passes_match_eager_on_every_feature(models):
    """inductor-gemm: passes of 2+ tokens compile on frozen weights through the GEMM template; q = 1 stays as is."""
    from torch._dynamo.utils import counters

    model = models['features']  # biases, per-layer inputs, KV sharing, attention_k_eq_v, softcapping
    eager = FastCausalLM(model, CONTEXT, MAX_QUERY, 'eager')
    compiled = FastCausalLM(model, CONTEXT, MAX_QUERY, 'inductor-gemm')
    assert compiled.lean.row_product_max_rows == 1
    counters.clear()
    report = compiled.warmup()
    assert (report.mode, report.graphs, report.direct_graphs) == ('inductor-gemm', 2, 2)  # q = 1; q >= 2 frozen
    assert counters['inductor']['cpp_templated_kernel_counter'] > 0  # the products are the template's kernels
    prompt = torch.tensor([[2, *range(10, 30)]])
    eager.prefill(prompt)
    compiled.prefill(prompt)
    token = torch.tensor([[7]])
    with torch.compiler.set_stance('fail_on_recompile'):
        for q in [1, 3, 9, 2] * 4:  # crosses the sliding window several times
            token = _verify_pass_matches(eager, compiled, token, q).logits[:, :1].argmax(-1)


def test_compiled_assistant_round_recompiles_when_threads_change(models):
    """Within a draft round, a thread-count change recompiles the step (its graphs are per thread count)."""
    target = models['plain']
    assistant = _assistant(target, ordered=True)
    eager = FastCausalLM(target, CONTEXT, MAX_QUERY, 'eager')
    compiled, expected = FastAssistant(assistant, eager, 'inductor'), FastAssistant(assistant, eager, 'eager')
    compiled.warmup()
    out = eager.prefill(torch.tensor([[2, *range(10, 30)]]))
    token, hidden = out.logits[:, -1:].argmax(-1), out.hidden[:, -1:]
    threads = torch.get_num_threads()
    try:
        with compiled.drafting(eager.length) as step, expected.drafting(eager.length) as expected_step:
            for index in range(4):
                if index == 2:
                    torch.set_num_threads(threads + 1)
                got, want = step(token, hidden), expected_step(token, hidden)
                _close(got.logits, want.logits)
                _close(got.hidden, want.hidden)
                token, hidden = want.logits.argmax(-1), want.hidden
    finally:
        torch.set_num_threads(threads)


def test_compiled_steps_are_called_without_dynamo_within_their_guards():
    """A step's graphs run directly once matched, per thread count, only on sizes their shape guards accept."""
    steps = _Steps('inductor', torch.device('cpu'), 64, cpp_wrapper=False, row_product_max_rows=1)  # q >= 2: dynamic
    slots = torch.zeros(64, 4)

    def write_and_read(x, positions, kv_positions):  # idempotent, as the engine's steps are
        slots.index_copy_(0, positions, x * 2)
        scale = 3 if x.shape[0] <= 3 else 5  # a shape guard: q = 2..3 and q >= 4 need graphs of their own
        return slots[:kv_positions.shape[0]].sum(0, keepdim=True), x * scale

    def run(step, start: int, q: int):
        x, positions = torch.randn(q, 4), torch.arange(start, start + q)
        return x, steps.run((step.__name__,), lambda: step, (x, positions), torch.arange(start + q), (0, 0))

    threads = torch.get_num_threads()
    try:
        for thread_count in (threads, threads + 1):  # another count: dynamo recompiles, and the graphs are recorded
            torch.set_num_threads(thread_count)
            for start, q in [(0, 3), (3, 2), (5, 7), (12, 3), (15, 4)]:
                x, (total, scaled) = run(write_and_read, start, q)
                assert torch.allclose(total, slots[:start + q].sum(0, keepdim=True))
                assert torch.equal(slots[start:start + q], x * 2) and torch.equal(scaled, x * (3 if q <= 3 else 5))
            direct = next(iter(steps._direct.values()))
            assert (steps.count, steps.direct_count, direct.records) == (1, 1, 2)  # one variant, two graphs
    finally:
        torch.set_num_threads(threads)
    calls = torch.zeros(1)

    def count_calls(x, positions, kv_positions):  # not idempotent: the rerun that confirms a graph gives 2, not 1
        calls.add_(1)
        return calls + 0, x + 1

    assert run(count_calls, 0, 2)[1][0].item() == 1 and steps.direct_count == 1  # not confirmed
    assert run(count_calls, 2, 2)[1][0].item() == 3  # through dynamo, after the compile's call and its rerun


def test_a_compiled_step_keeps_no_traced_module(monkeypatch):
    """Once inductor compiled a step, dynamo's traced GraphModule is freed; the step still runs directly."""
    traced = []
    compile_traced = _DirectGraph.__call__

    def spy(self, graph_module, example_inputs):
        traced.append(weakref.ref(graph_module))
        return compile_traced(self, graph_module, example_inputs)

    monkeypatch.setattr(_DirectGraph, '__call__', spy)
    steps = _Steps('inductor', torch.device('cpu'), 64, cpp_wrapper=False, row_product_max_rows=1)  # q >= 2: dynamic

    def scale(x, positions, kv_positions):
        return x * 3, positions + kv_positions.shape[0]

    for q in (2, 3):
        x, positions = torch.randn(q, 4), torch.arange(q)
        scaled, shifted = steps.run(('scale',), lambda: scale, (x, positions), torch.arange(q), (0, 0))
        assert torch.equal(scaled, x * 3) and torch.equal(shifted, positions + q)
    gc.collect()
    assert len(traced) == 1 and traced[0]() is None
    assert steps.direct_count == 1


@pytest.mark.parametrize('mode', ['eager', 'inductor'])
def test_greedy_drafts_are_the_argmax_of_each_step(models, mode):
    """Greedy rounds run several steps per call (GREEDY_STEPS): the same drafts and confidences as step by step."""
    target = models['plain']
    eager = FastCausalLM(target, CONTEXT, MAX_QUERY, 'eager')
    assistant = FastAssistant(_assistant(target, ordered=True), eager, mode)
    assistant.warmup()
    out = eager.prefill(torch.tensor([[2, *range(10, 30)]]))
    first_token, first_hidden = out.logits[:, -1:].argmax(-1), out.hidden[:, -1:]
    for k in (1, 3, 4, 7, 8):  # one call, two, one, three, one
        tokens, confidences = assistant.greedy_drafts(first_token, first_hidden, eager.length, k)
        token, hidden, expected_tokens, expected_confidences = first_token, first_hidden, [], []
        for _ in range(k):
            step = assistant.step(token, hidden, eager.length)
            probs = torch.softmax(step.logits[0, -1].float(), dim=-1)
            token, hidden = probs.argmax().view(1, 1), step.hidden
            expected_tokens.append(token.item())
            expected_confidences.append(probs.max())
        assert tokens.tolist() == expected_tokens
        _close(confidences, torch.stack(expected_confidences))
    # a cut-off ends the round at its first draft under it, included (as DraftRound's), in any call of the round
    for cutoff in [c.item() + 1e-6 for c in expected_confidences]:
        keep = 1 + next(i for i, c in enumerate(expected_confidences) if c < cutoff)
        tokens, confidences = assistant.greedy_drafts(first_token, first_hidden, eager.length, 7, cutoff)
        assert tokens.tolist() == expected_tokens[:keep] and confidences.shape == (keep,)


def test_exact_half_dtype_keeps_every_value():
    from gemma_spec_ros.engine.runtime.model.weights import exact_half_dtype

    bfloat16_values = torch.tensor([1.0, -0.15625, 3.0 * 2 ** -20, 2.0 ** 100])  # 8-bit mantissas, wide range
    float16_values = torch.tensor([1.0 + 2 ** -10, -65504.0])                       # 11-bit mantissas
    assert exact_half_dtype([bfloat16_values]) == torch.bfloat16
    assert exact_half_dtype([float16_values]) == torch.float16
    assert exact_half_dtype([bfloat16_values, float16_values]) is None  # one dtype for every matrix
    assert exact_half_dtype([torch.tensor([1.0 + 2 ** -12])]) is None


@pytest.mark.parametrize('max_rows, blocked', [(1, False), (4, False), (4, True)])
def test_compiled_cpu_products_match_aten(max_rows, blocked):
    """Compiled for CPU, passes of up to row_product_max_rows rows are fused multiply-reduces, longer ones aten's."""
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    matrix, bias = torch.randn(48, 32).to(torch.bfloat16), torch.randn(48)  # a 16-bit weight, as store_exact_half
    weight = weights.block_matrix(matrix) if blocked else matrix
    for rows in (1, 3, 5):
        x = torch.randn(rows, 32)

        def product(x, weight, bias):  # a fresh function per compile: nothing cached from another case
            return layers._linear(x, weight, bias, max_rows)
        out, code = run_and_get_code(torch.compile(product, fullgraph=True, dynamic=False), x, weight, bias)
        code = ''.join(code)
        _close(out, torch.nn.functional.linear(x, matrix.float(), bias))
        aten_product = 'extern_kernels.bmm(' if blocked else 'extern_kernels.addmm('  # blocked: by blocks
        assert (aten_product in code) == (rows > max_rows)
        if rows <= max_rows:  # one kernel whose loop keeps an accumulator per row: the weight is read once
            assert len(set(re.findall(r'cpp_fused_\w+', code))) == 1 and 'tmp_acc{}'.format(rows - 1) in code
        _close(layers._linear(x, weight, bias, max_rows), torch.nn.functional.linear(x, matrix.float(), bias))


def test_blocked_matrices_stay_shared_with_the_model():
    """Blocked layer matrices live in the flat buffer as the model's (now 3-D) parameters; steps compute as before."""
    import copy

    model = _build('plain')
    reference = copy.deepcopy(model)
    matrix = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    assert torch.equal(weights.block_matrix(matrix)[1, :, 3], matrix[weights.BLOCK_WIDTH + 3])  # output 19
    for rows in (layers.BLOCKED_BATCH_MAX_ROWS, layers.BLOCKED_BATCH_MAX_ROWS + 1):  # block by block, unblocked
        x = torch.randn(rows, matrix.shape[1])
        _close(layers._linear(x, weights.block_matrix(matrix)), torch.nn.functional.linear(x, matrix))
    blocked = fast_model.LeanGemma4(model, blocked=True)
    q_proj = model.model.layers[0].self_attn.q_proj.weight
    assert torch.equal(q_proj, weights.block_matrix(matrix)) and _inside(q_proj, blocked.tensors.buffers)
    assert model.model.embed_tokens.weight.dim() == 2  # only the layers' matrices
    again = fast_model.LeanGemma4(model)  # another lean model on the same parameters keeps them blocked
    assert model.model.layers[0].self_attn.q_proj.weight.dim() == 3
    plain = fast_model.LeanGemma4(reference)
    ids = torch.tensor([[2, *range(10, 30)]])
    with torch.inference_mode():
        expected = plain.prefill(ids, plain.new_cache(CONTEXT, MAX_QUERY), 0, 3).logits
        for lean in (blocked, again):
            _close(lean.prefill(ids, lean.new_cache(CONTEXT, MAX_QUERY), 0, 3).logits, expected)
        with pytest.raises(RuntimeError):  # transformers' forward fails instead of reading the blocked layout
            model(ids)


def test_each_pass_of_row_products_gets_a_static_graph_longer_passes_share_one():
    assert [query_variant(q, row_product_max_rows=4) for q in range(1, 10)] == [1, 2, 3, 4, 5, 5, 5, 5, 5]
    assert [query_variant(q, row_product_max_rows=1) for q in range(1, 5)] == [1, 2, 2, 2]  # inductor-gemm


def test_the_row_products_reach_as_far_as_the_cpu_makes_them_pay_unless_the_user_sets_it(monkeypatch):
    monkeypatch.delenv(layers.ROW_PRODUCT_MAX_ROWS_ENV)  # the tests' conftest sets it
    by_cpu = layers.resolve_row_product_max_rows(0)
    assert by_cpu == layers.cpu_row_product_max_rows() == (
        1 if 'GenuineIntel' in cpu_ops.cpu_info() and torch.backends.mkl.is_available() else
        9 if torch.backends.cpu.get_cpu_capability() == 'AVX512' else 4)
    assert layers.resolve_row_product_max_rows(5) == 5  # engine.row_product_max_rows
    monkeypatch.setenv(layers.ROW_PRODUCT_MAX_ROWS_ENV, '3')
    assert layers.resolve_row_product_max_rows(0) == 3
    assert layers.resolve_row_product_max_rows(6) == 6  # the parameter wins over the tests' override
    for bad in ('0', 'many', '-2', '2.5'):
        monkeypatch.setenv(layers.ROW_PRODUCT_MAX_ROWS_ENV, bad)
        with pytest.raises(ValueError, match='GEMMA_SPEC_ROW_PRODUCT_MAX_ROWS must be a whole number of rows >= 1'):
            layers.resolve_row_product_max_rows(0)


def test_the_compile_cache_outlives_a_reboot_unless_the_user_chose_one(monkeypatch, tmp_path):
    monkeypatch.delenv('TORCHINDUCTOR_CACHE_DIR', raising=False)
    monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path))
    assert compile_cache_dir() == str(tmp_path / 'gemma_spec_ros' / 'torchinductor')
    assert os.environ['TORCHINDUCTOR_CACHE_DIR'] == compile_cache_dir()  # what inductor reads
    from torch._inductor.runtime.cache_dir_utils import cache_dir, default_cache_dir

    monkeypatch.setenv('TORCHINDUCTOR_CACHE_DIR', default_cache_dir())  # what importing inductor's config writes
    assert compile_cache_dir() == cache_dir() == str(tmp_path / 'gemma_spec_ros' / 'torchinductor')
    monkeypatch.setenv('TORCHINDUCTOR_CACHE_DIR', '/elsewhere')
    assert compile_cache_dir() == '/elsewhere'


def test_only_inductor_steps_within_the_row_products_store_blocked_matrices():
    assert stores_blocked('inductor', 9, row_product_max_rows=9)
    assert not stores_blocked('inductor', 9, row_product_max_rows=4)  # q 5..9 would multiply block by block
    assert not stores_blocked('inductor-gemm', 9, row_product_max_rows=9)  # its GEMM template takes 2-D weights
    assert not stores_blocked('eager', 9, row_product_max_rows=9)


def _rounded_to(model, dtype: torch.dtype):
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(parameter.to(dtype).float())
    return model


def test_compiled_assistant_stores_exact_half_weights(models):
    """With bfloat16 values, the compiled assistant keeps its matrices in bfloat16 and steps as float32 ones do."""
    import copy

    target = models['plain']
    reference = _rounded_to(_assistant(target, ordered=True), torch.bfloat16)
    assistant = copy.deepcopy(reference)
    eager = FastCausalLM(target, CONTEXT, MAX_QUERY, 'eager')
    compiled = FastAssistant(assistant, eager, 'inductor')
    assert compiled.weights_dtype == torch.bfloat16
    matrices = [p for p in assistant.parameters() if p.dim() == 2]
    assert matrices and all(p.dtype == torch.bfloat16 for p in matrices)
    assert all(p.dtype == torch.float32 for p in assistant.parameters() if p.dim() == 1)  # norms stay float32
    buffers = compiled.lean.tensors.buffers  # the compiled steps read the 16-bit matrices, not float32 copies
    assert [buffer.dtype for buffer in buffers] == [torch.bfloat16, torch.float32, torch.int64]
    assert all(_inside(p, buffers) for p in matrices)
    expected = FastAssistant(reference, eager, 'eager')
    out = eager.prefill(torch.tensor([[2, *range(10, 30)]]))
    for _ in range(2 * WINDOW):  # target greedy decoding through the sliding window, the assistant drafting
        token, hidden = out.logits[:, -1:].argmax(-1), out.hidden[:, -1:]
        want, got = expected.step(token, hidden, eager.length), compiled.step(token, hidden, eager.length)
        _close(got.logits, want.logits)
        _close(got.hidden, want.hidden)
        out = eager.step(token)

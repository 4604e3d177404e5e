"""The C++ CPU ops (runtime/ops/cpu_ops.py): attention against SDPA, int8 products against float64, and the fallback."""

import os
import signal
import subprocess
import sys
import time
import warnings

import pytest
import torch
import torch.nn.functional as F

from gemma_spec_ros.engine.runtime.ops import cpu_ops
from gemma_spec_ros.engine.runtime.quant.quantize import (
    Quantizer,
    dequantized_int4,
    embedding,
    int8_rows,
    quantized_linear,
    rounded_activations,
)


def _sdpa(query, keys, values, mask):
    out = F.scaled_dot_product_attention(query.transpose(0, 1)[None], keys[None], values[None], attn_mask=mask,
                                         scale=1.0, enable_gqa=True)
    return out[0].transpose(0, 1).reshape(query.shape[0], -1)


@pytest.mark.parametrize('heads, kv_heads', [(4, 2), (4, 4), (8, 1)])
def test_the_op_equals_sdpa_and_each_row_alone_gives_the_same_bits(heads, kv_heads):
    assert cpu_ops.ensure_built(), 'this machine has a C++ compiler: the op must build'
    generator = torch.Generator().manual_seed(0)
    for q, d, length in [(1, 64, 1), (1, 64, 138), (4, 128, 301), (9, 256, 57), (3, 24, 10)]:
        query = torch.randn(q, heads, d, generator=generator) * d ** -0.5  # scores of a normed query
        cache = torch.randn(2, kv_heads, length + 40, d, generator=generator)  # keys/values: views of a longer cache
        keys, values = cache[0, :, :length], cache[1, :, :length]
        mask = torch.rand(q, length, generator=generator) > 0.3
        mask[:, 0] = True
        out = cpu_ops.decode_attention(query, keys, values, mask)
        torch.testing.assert_close(out, _sdpa(query, keys, values, mask), atol=1e-5, rtol=1e-5)
        alone = torch.cat([cpu_ops.decode_attention(query[i:i + 1], keys, values, mask[i:i + 1])
                           for i in range(q)])
        assert torch.equal(alone, out)  # what makes verify passes and one-token steps agree to the bit
        wider_mask = torch.cat([torch.zeros(q, 3, dtype=torch.bool), mask, torch.zeros(q, 40, dtype=torch.bool)], 1)
        hidden = torch.randn(2, kv_heads, 43, d, generator=generator)  # 3 keys before, 40 after: a static step's
        wider = cpu_ops.decode_attention(query, *(torch.cat([hidden[k, :, :3], part, hidden[k, :, 3:]], dim=1)
                                                  for k, part in enumerate((keys, values))), wider_mask)
        assert torch.equal(wider, out)


def test_the_op_runs_only_for_float32_queries_of_whole_vectors():
    assert cpu_ops.ensure_built()
    assert cpu_ops.attention_usable(torch.zeros(1, 4, 64))
    assert not cpu_ops.attention_usable(torch.zeros(1, 4, 64, dtype=torch.float64))  # a quantized model's attention
    assert not cpu_ops.attention_usable(torch.zeros(1, 4, 64, dtype=torch.bfloat16))
    assert not cpu_ops.attention_usable(torch.zeros(1, 4, 20))


def test_a_failed_build_leaves_the_fallbacks_and_says_why(monkeypatch, tmp_path):
    broken = tmp_path / 'broken.cpp'
    broken.write_text('this is not C++\n')
    monkeypatch.setattr(cpu_ops, 'SOURCES', (broken,))
    monkeypatch.setattr(cpu_ops, '_state', {'built': False, 'failure': ''})
    monkeypatch.setenv('TORCHINDUCTOR_CACHE_DIR', str(tmp_path / 'cache'))
    with pytest.warns(cpu_ops.CpuOpsWarning, match='CPU attention uses SDPA and int8 products a float product'):
        assert not cpu_ops.ensure_built()
    assert not cpu_ops.attention_usable(torch.zeros(1, 4, 64))
    assert not cpu_ops.int8_linear_usable(torch.zeros(1, 64))
    quantized = Quantizer('int8').table(torch.nn.Parameter(torch.randn(16, 64)))
    x = torch.randn(3, 64)
    assert quantized.tile == 8  # stored for the op, which is not there: the fallback reads the rows back
    reference = rounded_activations(x).double() @ (int8_rows(quantized).double() * quantized.scales.double()[:, None]).T
    torch.testing.assert_close(quantized_linear(x, quantized).double(), reference, atol=1e-5, rtol=1e-5)
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        assert not cpu_ops.ensure_built()  # tried once, said once


BUILD = """
import sys, warnings
from pathlib import Path
from gemma_spec_ros.engine.runtime.ops import cpu_ops
cpu_ops.SOURCES = (Path(sys.argv[1]),)
with warnings.catch_warnings(record=True) as said:
    warnings.simplefilter('always')
    cpu_ops.ensure_built()   # this test's library has none of the ops' schemas: it loads, then says so
library = cpu_ops.build_directory() / 'gemma_spec_cpu_ops.so'
print('built' if library.exists() else 'not built', [str(w.message) for w in said if 'CPU ops' in str(w.message) or
                                                     'lock' in str(w.message)], flush=True)
"""


def test_a_builder_killed_mid_build_leaves_a_lock_that_the_next_start_takes_over(tmp_path):
    source = tmp_path / 'ops.cpp'   # a library that takes a second or two to compile
    source.write_text('#include <iostream>\n#include <map>\n#include <regex>\n#include <string>\n'
                      'int gemma_spec_test_op() { return std::regex_match(std::string("a"), std::regex("a")); }\n')
    env = {**os.environ, 'TORCHINDUCTOR_CACHE_DIR': str(tmp_path / 'cache')}
    builder = subprocess.Popen([sys.executable, '-c', BUILD, str(source)], env=env, start_new_session=True,
                               stdout=subprocess.PIPE, text=True)
    extensions = tmp_path / 'cache' / 'gemma_spec_extensions'
    deadline = time.monotonic() + 120
    while not list(extensions.glob('cpu_ops_*/lock')) and time.monotonic() < deadline and builder.poll() is None:
        time.sleep(0.05)
    locks = list(extensions.glob('cpu_ops_*/lock'))
    assert locks, 'the builder never took torch\'s build lock'
    os.killpg(builder.pid, signal.SIGKILL)   # the compiler with it, as a power cut would
    builder.wait(timeout=30)
    assert locks[0].exists()   # left behind: cpp_extension.load alone would wait on it for ever
    restart = subprocess.run([sys.executable, '-c', BUILD, str(source)], env=env, capture_output=True, text=True,
                             timeout=300)
    assert restart.stdout.startswith('built'), restart.stdout + restart.stderr[-2000:]
    assert 'removed the stale build lock' in restart.stdout and not locks[0].exists()


def test_a_build_lock_held_too_long_by_a_live_process_gives_the_fallbacks(monkeypatch, tmp_path):
    monkeypatch.setenv('TORCHINDUCTOR_CACHE_DIR', str(tmp_path / 'cache'))
    monkeypatch.setattr(cpu_ops, '_state', {'built': False, 'failure': ''})
    monkeypatch.setattr(cpu_ops, 'BUILD_WAIT_S', 1.0)
    directory = cpu_ops.build_directory()
    directory.mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, '-c', 'import fcntl, sys, time; f = open(sys.argv[1], "w"); '
                               'fcntl.flock(f, fcntl.LOCK_EX); print("held", flush=True); time.sleep(120)',
                               str(directory / 'build.flock')], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == 'held'   # a builder that hangs (stopped, not dead)
        start = time.monotonic()
        with pytest.warns(cpu_ops.CpuOpsWarning, match=r'TimeoutError: another process held the build lock .* for '
                                                       r'over 1 s\); CPU attention uses SDPA'):
            assert not cpu_ops.ensure_built()
        assert time.monotonic() - start < 30
        assert not cpu_ops.int8_linear_usable(torch.zeros(1, 64))
    finally:
        holder.kill()
        holder.wait()


def _int8(outputs: int, inputs: int, generator: torch.Generator, tile: int | None = None):
    values = torch.randn(outputs, inputs, generator=generator) * 0.05
    return Quantizer('int8').quantize_values(values, False, tile)


def _dequantized(weight) -> torch.Tensor:
    return int8_rows(weight).double() * weight.scales.double()[:, None]


def _int8_linear(x: torch.Tensor, weights) -> torch.Tensor:
    assert len({w.tile for w in weights}) == 1
    return cpu_ops.int8_linear(x, tuple(w.data for w in weights), tuple(w.scales for w in weights), weights[0].tile)


def test_int8_products_equal_float64_and_each_row_alone_gives_the_same_bits():
    assert cpu_ops.ensure_built()
    generator = torch.Generator().manual_seed(0)
    for inputs, outputs in [(192, (256, 128, 128)), (768, (192,)), (32, (1, 7, 9)), (64, (33,))]:
        weights = [_int8(count, inputs, generator) for count in outputs]
        assert {w.tile for w in weights} == {1 if inputs == 32 or outputs == (33,) else 8}  # tiles where they fit
        x = torch.randn(11, inputs, generator=generator)
        x[:, :32] *= 50  # an outlier block: the other blocks keep their own scales
        out = _int8_linear(x, weights)
        dequantized = [_dequantized(w) for w in weights]
        exact = torch.cat([x.double() @ w.T for w in dequantized], dim=-1)
        rounded = torch.cat([rounded_activations(x).double() @ w.T for w in dequantized], dim=-1)
        torch.testing.assert_close(out.double(), rounded, atol=1e-5, rtol=1e-5)  # what rounded_activations says
        assert ((out.double() - exact).abs() / exact.abs().amax()).max() < 1e-4  # 16-bit levels: near the float one
        for rows in range(1, 11):  # tiles of 2 and 1 rows
            assert torch.equal(_int8_linear(x[:rows], weights), out[:rows])
        more = torch.cat([x, torch.randn(26, inputs, generator=torch.Generator().manual_seed(inputs))])
        longer = _int8_linear(more, weights)
        assert torch.equal(longer[:11], out)  # three blocks of 16 rows, the last odd: the same bits per row
        for rows in (16, 17, 33):
            assert torch.equal(_int8_linear(more[:rows], weights), longer[:rows])
        alone = [quantized_linear(x[3:4], w) for w in weights]  # one matrix a call, as the other products run
        assert torch.equal(torch.cat(alone, dim=-1)[0], out[3])


def test_an_int8_matrix_gives_the_same_bits_row_major_or_tile_major():
    """The tile only moves a matrix's bytes: products, and embedding rows gathered from it, stay bit for bit."""
    assert cpu_ops.ensure_built()
    values = torch.randn(64, 96, generator=torch.Generator().manual_seed(4)) * 0.05
    rows, tiled = (Quantizer('int8').quantize_values(values, False, tile) for tile in (1, 8))
    assert rows.tile == 1 and tiled.tile == 8 and not torch.equal(rows.data, tiled.data)
    assert torch.equal(int8_rows(tiled), rows.data) and torch.equal(tiled.scales, rows.scales)
    x = torch.randn(19, 96, generator=torch.Generator().manual_seed(5))
    assert torch.equal(_int8_linear(x, [rows]), _int8_linear(x, [tiled]))
    ids = torch.tensor([[0, 7, 8, 63], [9, 9, 1, 56]])
    assert torch.equal(embedding(ids, tiled, torch.float32), embedding(ids, rows, torch.float32))
    assert torch.equal(embedding(ids, rows, torch.float32)[1, 0], rows.data[9].float() * rows.scales[9])
    with pytest.raises(RuntimeError, match='tile must be 1 or 8'):
        cpu_ops.int8_linear(x, (rows.data,), (rows.scales,), 4)
    with pytest.raises(RuntimeError, match='multiple of 8 outputs'):
        cpu_ops.int8_linear(x, (rows.data[:12],), (rows.scales[:12],), 8)


def test_int4_products_equal_the_dequantized_product_and_each_row_alone_gives_the_same_bits():
    """int4_linear: two levels a byte, a float16 scale and low a group, over int8_linear's 16-bit activation levels."""
    assert cpu_ops.ensure_built()
    generator = torch.Generator().manual_seed(2)
    for inputs, outputs in [(192, (200, 64)), (64, (8, 16)), (32, (24,))]:
        weights = [Quantizer('int4').matrix(torch.nn.Parameter(torch.randn(count, inputs, generator=generator)
                                                               * 0.05)) for count in outputs]
        assert all(w.group_size == 32 and w.data.dtype == torch.uint8 for w in weights)
        x = torch.randn(37, inputs, generator=generator)
        x[:, :32] *= 50  # an outlier block
        out = cpu_ops.int4_linear(x, tuple(w.data for w in weights), tuple(w.scales for w in weights))
        reference = torch.cat([rounded_activations(x).double() @ dequantized_int4(w).double().T for w in weights], -1)
        assert ((out.double() - reference).abs().max() / reference.abs().max()) < 1e-5
        for rows in (1, 2, 3, 16, 17, 33):  # tiles of 2 and 1 rows, one or more row blocks
            part = cpu_ops.int4_linear(x[:rows], tuple(w.data for w in weights), tuple(w.scales for w in weights))
            assert torch.equal(part, out[:rows])
        alone = [quantized_linear(x[5:6], w) for w in weights]
        assert torch.equal(torch.cat(alone, dim=-1)[0], out[5])


def test_the_ops_give_the_same_bits_on_one_thread_or_two():
    """The ops split a matrix's outputs (attention: its heads) among torch's threads; each is computed the same way."""
    assert cpu_ops.ensure_built()
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(5, 128, generator=generator)
    int8 = Quantizer('int8').matrix(torch.nn.Parameter(torch.randn(1000, 128, generator=generator) * 0.05))
    int4 = Quantizer('int4').matrix(torch.nn.Parameter(torch.randn(1000, 128, generator=generator) * 0.05))
    query, cache = torch.randn(3, 8, 64, generator=generator) * 0.125, torch.randn(2, 4, 200, 64, generator=generator)
    mask = torch.rand(3, 200, generator=generator) > 0.2
    mask[:, 0] = True
    previous = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append((_int8_linear(x, [int8]), cpu_ops.int4_linear(x, (int4.data,), (int4.scales,)),
                         cpu_ops.decode_attention(query, cache[0], cache[1], mask)))
    finally:
        torch.set_num_threads(previous)
    assert all(torch.equal(one, two) for one, two in zip(*outs, strict=True))


def test_int8_products_take_float32_rows_of_whole_blocks_only():
    assert cpu_ops.ensure_built()
    assert cpu_ops.int8_linear_usable(torch.zeros(2, 64))
    assert not cpu_ops.int8_linear_usable(torch.zeros(2, 48))
    assert not cpu_ops.int8_linear_usable(torch.zeros(2, 64, dtype=torch.bfloat16))
    weight = _int8(5, 48, torch.Generator().manual_seed(1))
    x = torch.randn(2, 48)
    reference = rounded_activations(x).double() @ _dequantized(weight).T
    torch.testing.assert_close(quantized_linear(x, weight).double(), reference, atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match='multiple of 32'):
        _int8_linear(x, [weight])


def test_the_feed_forward_op_is_its_products_and_gelu_gate_row_by_row():
    """int8_feed_forward equals int8_linear's gate and up, aten's tanh gelu, then int8_linear's down."""
    assert cpu_ops.ensure_built()
    generator = torch.Generator().manual_seed(2)
    for inputs, hidden, outputs, tile in [(192, 768, 192, 8), (64, 96, 40, 8), (32, 32, 3, 1)]:
        gate, up = _int8(hidden, inputs, generator, tile), _int8(hidden, inputs, generator, tile)
        down = _int8(outputs, hidden, generator, tile)
        x = torch.randn(11, inputs, generator=generator) * 4  # gelu's curved part and both tails
        out = cpu_ops.int8_feed_forward(x, gate[:2], up[:2], down[:2], tile)
        gate_out, up_out = _int8_linear(x, [gate, up]).split(hidden, -1)
        reference = _int8_linear(F.gelu(gate_out, approximate='tanh') * up_out, [down])
        torch.testing.assert_close(out, reference, atol=1e-4, rtol=1e-4)
        for rows in range(1, 11):
            part = cpu_ops.int8_feed_forward(x[:rows], gate[:2], up[:2], down[:2], tile)
            assert torch.equal(part, out[:rows])  # what keeps verify passes and one-token steps equal
    with pytest.raises(RuntimeError, match='multiples of 32'):  # the hidden width too: down rounds its input
        odd = _int8(48, 64, generator, 1)
        down = (_int8(8, 48, generator, 1).data, torch.rand(8))
        cpu_ops.int8_feed_forward(torch.randn(1, 64), odd[:2], odd[:2], down, 1)

"""The C++ attention op of compiled CPU steps (runtime/cpu_attention.py) against SDPA, and its fallback."""

import warnings

import pytest
import torch
import torch.nn.functional as F

from gemma_spec_ros.engine.runtime import cpu_attention


def _sdpa(query, keys, values, mask):
    out = F.scaled_dot_product_attention(query.transpose(0, 1)[None], keys[None], values[None], attn_mask=mask,
                                         scale=1.0, enable_gqa=True)
    return out[0].transpose(0, 1).reshape(query.shape[0], -1)


@pytest.mark.parametrize('heads, kv_heads', [(4, 2), (4, 4), (8, 1)])
def test_the_op_equals_sdpa_and_each_row_alone_gives_the_same_bits(heads, kv_heads):
    assert cpu_attention.ensure_built(), 'this machine has a C++ compiler: the op must build'
    generator = torch.Generator().manual_seed(0)
    for q, d, length in [(1, 64, 1), (1, 64, 138), (4, 128, 301), (9, 256, 57), (3, 24, 10)]:
        query = torch.randn(q, heads, d, generator=generator) * d ** -0.5  # scores of a normed query
        cache = torch.randn(2, kv_heads, length + 40, d, generator=generator)  # keys/values: views of a longer cache
        keys, values = cache[0, :, :length], cache[1, :, :length]
        mask = torch.rand(q, length, generator=generator) > 0.3
        mask[:, 0] = True
        out = cpu_attention.decode_attention(query, keys, values, mask)
        torch.testing.assert_close(out, _sdpa(query, keys, values, mask), atol=1e-5, rtol=1e-5)
        alone = torch.cat([cpu_attention.decode_attention(query[i:i + 1], keys, values, mask[i:i + 1])
                           for i in range(q)])
        assert torch.equal(alone, out)  # what makes verify passes and one-token steps agree to the bit


def test_the_op_runs_only_for_float32_queries_of_whole_vectors():
    assert cpu_attention.ensure_built()
    assert cpu_attention.usable(torch.zeros(1, 4, 64))
    assert not cpu_attention.usable(torch.zeros(1, 4, 64, dtype=torch.float64))  # a quantized model's attention
    assert not cpu_attention.usable(torch.zeros(1, 4, 64, dtype=torch.bfloat16))
    assert not cpu_attention.usable(torch.zeros(1, 4, 20))


def test_a_failed_build_leaves_sdpa_and_says_why(monkeypatch, tmp_path):
    broken = tmp_path / 'broken.cpp'
    broken.write_text('this is not C++\n')
    monkeypatch.setattr(cpu_attention, 'SOURCE', broken)
    monkeypatch.setattr(cpu_attention, '_state', {'built': False, 'failure': ''})
    monkeypatch.setenv('TORCHINDUCTOR_CACHE_DIR', str(tmp_path / 'cache'))
    with pytest.warns(cpu_attention.CpuAttentionWarning, match='compiled CPU steps use SDPA'):
        assert not cpu_attention.ensure_built()
    assert not cpu_attention.usable(torch.zeros(1, 4, 64))
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        assert not cpu_attention.ensure_built()  # tried once, said once

"""ctxpar.hf_cache: model.generate of a random-init tiny Llama with its KV cache spread over 2
ranks (threads) gives the tokens of one process with transformers' own cache and SDPA."""
import pytest
import torch

import ctxpar
from test_inference import on_threads

transformers = pytest.importorskip("transformers")
from ctxpar import hf_cache  # noqa: E402

hf_cache.register()


def tiny_llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=256,
                                      attention_dropout=0.0, initializer_range=0.5)
    return transformers.LlamaForCausalLM(config).eval()


def generate(model, prompt, **kwargs):
    with torch.no_grad():
        return model.generate(prompt, max_new_tokens=8, do_sample=False, min_new_tokens=8,
                              **kwargs)


def test_generate_with_the_cache_spread_equals_one_process():
    model = tiny_llama()
    prompt = torch.randint(64, (2, 21), generator=torch.Generator().manual_seed(1))
    model.set_attn_implementation("sdpa")
    want = generate(model, prompt)
    # initializer_range 0.5: the tokens depend on the attention (at transformers' 0.02 this
    # model repeats one token whatever the attention gives, and a wrong one passed).
    assert min(len(set(row[21:].tolist())) for row in want) >= 5, want
    model.set_attn_implementation(hf_cache.NAME)

    def fn(comm):
        cache = hf_cache.SpreadCache(comm, model.config, batch=2, block=8)
        got = generate(model, prompt, cache=cache)
        # Each rank holds its share of every layer: 21 + 7 tokens (the last generated one is
        # not fed back), blocks of 8 on 2 ranks.
        return got, cache.layers[0].kv.local_tokens(0)

    results = on_threads(2, fn)
    for got, held in results:
        assert torch.equal(got, want), (got, want)
    assert [h for _, h in results] == [16, 12]


def test_padding_is_refused():
    model = tiny_llama()
    model.set_attn_implementation(hf_cache.NAME)
    prompt = torch.randint(64, (2, 9), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(prompt)
    mask[1, :3] = 0  # left padding of the shorter prompt

    def fn(comm):
        cache = hf_cache.SpreadCache(comm, model.config, batch=2, block=8)
        with pytest.raises(ValueError, match="attention_mask"):
            generate(model, prompt, attention_mask=mask, cache=cache)
        return cache.layers[0].kv.lengths

    assert on_threads(2, fn) == [[0, 0], [0, 0]]

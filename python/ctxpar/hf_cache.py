"""A Hugging Face `Cache` whose keys and values are spread over the ranks of a communicator
(one ctxpar.KVCache per layer), so that `model.generate` holds 1/P of the cache per rank:

    ctxpar.hf_cache.register()
    model = LlamaForCausalLM(config)                      # config._attn_implementation below
    model.config._attn_implementation = ctxpar.hf_cache.NAME
    cache = ctxpar.hf_cache.SpreadCache(comm, model.config)
    tokens = model.generate(input_ids, past_key_values=cache, do_sample=False, ...)

Every rank runs the whole model on the same tokens (replicated activations); the cache layer's
`update` stores nothing and hands the new keys and values to the attention function registered
under NAME, which runs the layer's KVCache.prefill (prompts) or decode (new tokens): only the
attention crosses ranks. Batches are of equal-length prompts without padding (a padding mask is
refused). See docs/inference.md, "Hugging Face generate".
"""
import threading

import torch

from .inference import KVCache

NAME = "ctxpar_kv"

# The layer whose update ran last on this thread: transformers calls the cache's update, then
# the attention function, which is not given the cache.
_local = threading.local()


def _layer_base():
    from transformers.cache_utils import CacheLayerMixin
    return CacheLayerMixin


def _cache_base():
    from transformers.cache_utils import Cache
    return Cache


def _make_classes():
    class SpreadLayer(_layer_base()):
        """One layer's keys and values, spread (a ctxpar.KVCache of `batch` sequences)."""

        is_sliding = False

        def __init__(self, kv):
            super().__init__()
            self.kv = kv

        def lazy_initialization(self, key_states, value_states):
            self.is_initialized = True

        def update(self, key_states, value_states, *args, **kwargs):
            # key_states [B, Hkv, T, D], the new tokens: handed on as they are; spread_attention
            # stores them in this layer's KVCache as it attends.
            _local.layer = self
            return key_states, value_states

        def get_mask_sizes(self, query_length):
            return self.get_seq_length() + query_length, 0

        def get_seq_length(self):
            return self.kv.tokens(0)

        def get_max_length(self):
            return -1

    class SpreadCache(_cache_base()):
        """`Cache` of `config.num_hidden_layers` spread layers for `batch` sequences."""

        def __init__(self, comm, config, batch=1, block=64, dtype="float32"):
            heads = config.num_attention_heads
            head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
            kv_heads = getattr(config, "num_key_value_heads", None) or heads
            layers = [SpreadLayer(KVCache(comm, kv_heads=kv_heads, head_dim=head_dim,
                                          sequences=batch, block=block, dtype=dtype))
                      for _ in range(config.num_hidden_layers)]
            super().__init__(layers=layers)

    return SpreadLayer, SpreadCache


_classes = None


def __getattr__(name):
    # transformers is imported on first use, not with ctxpar.
    global _classes
    if name in ("SpreadLayer", "SpreadCache"):
        if _classes is None:
            _classes = _make_classes()
        return _classes[0] if name == "SpreadLayer" else _classes[1]
    raise AttributeError(name)


def spread_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                     **kwargs):
    """transformers' attention interface: query [B, Hq, T, D], key, value [B, Hkv, T, D] (the
    new tokens only) -> ([B, T, Hq, D], None), through this layer's spread cache."""
    layer = getattr(_local, "layer", None)
    _local.layer = None
    if layer is None:
        raise RuntimeError(f'attn_implementation="{NAME}" needs past_key_values='
                           "ctxpar.hf_cache.SpreadCache(comm, config) (and use_cache=True)")
    if dropout:
        raise ValueError(f"{NAME}: dropout must be 0 (inference), got {dropout}")
    D = query.shape[-1]
    if scaling is not None and abs(scaling - D ** -0.5) > 1e-12 * D ** -0.5:
        raise ValueError(f"{NAME}: the model's attention scale {scaling} is not 1/sqrt(head_dim)"
                         f" = {D ** -0.5}; the spread cache uses the latter")
    B, T = query.shape[0], query.shape[2]
    q, k, v = (x.transpose(1, 2).contiguous() for x in (query, key, value))
    kv = layer.kv
    if T == 1 and kv.tokens(0) > 0:
        out = kv.decode(q, k, v, return_lse=False)
    else:
        outs = kv.prefill([q[b:b + 1] for b in range(B)], [k[b:b + 1] for b in range(B)],
                          [v[b:b + 1] for b in range(B)], seq=list(range(B)), return_lse=False)
        out = torch.cat(outs)
    return out.to(query.dtype), None


def register():
    """Registers NAME with transformers' attention and mask interfaces. The mask function is
    ctxpar.hf's: it builds none (the cache is causal) and refuses padding."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from .hf import mask_interface
    AttentionInterface.register(NAME, spread_attention)
    AttentionMaskInterface.register(NAME, mask_interface)

"""Finite inputs whose attention scores or gradients go beyond the fp32 range: an error naming
the first global token and head (the LSE came out inf, or -inf as if masked, with no error)."""
import numpy as np
import pytest

import ctxpar


def overflowing(T=64, Hq=2, Hkv=1, D=16):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, T, Hq, D)).astype(np.float32)
    k = rng.standard_normal((1, T, Hkv, D)).astype(np.float32)
    v = rng.standard_normal((1, T, Hkv, D)).astype(np.float32)
    q[0, 40, 1, :] = 1e20  # q . k = 1.6e41 at (token 40, head 1) against key 3: +inf in fp32
    k[0, 3, 0, :] = 1e20
    return q, k, v


@pytest.mark.parametrize("strategy", ["ring", "allgather", "ulysses"])
def test_attention_raises_naming_token_and_head(strategy):
    q, k, v = overflowing()
    with pytest.raises(ValueError, match=r"non-finite output .*lse = inf at token position 40, "
                                         r"batch 0, head 1"):
        ctxpar.attention(q, k, v, ranks=2, strategy=strategy, mask="causal")


def test_huge_scale_raises():
    rng = np.random.default_rng(1)
    q = np.abs(rng.standard_normal((1, 32, 2, 16))).astype(np.float32) + 0.1
    k = np.abs(rng.standard_normal((1, 32, 2, 16))).astype(np.float32) + 0.1
    with pytest.raises(ctxpar.Error, match="at token position 0, batch 0, head 0"):
        ctxpar.attention(q, k, k, scale=1e38)


def test_finite_results_pass():
    q, k, v = overflowing()
    q[0, 40, 1, :] = 1.0
    out, lse = ctxpar.attention(q, k, v, ranks=2, mask="causal")
    assert np.isfinite(out).all() and np.isfinite(lse).all()

"""ctxpar.KVCache refuses bad input before anything changes: a refused prefill or decode leaves
the cache as a twin that never saw the call (its lengths, and the next calls' outputs bitwise);
masks that let a token see later ones and batch sizes beyond the command's range are refused
before the cache exists. docs/faults.md, "Round six: the KV cache and decode"."""
import pytest
import torch

import ctxpar
from ctxpar import _checks
import inference_case as case
from test_inference import on_threads


def twins(comm, seq_len=40):
    """Two caches given the same first seq_len tokens (prefilled), and the whole problem."""
    q, k, v, _ = case.whole_problem([seq_len + 30])[0]
    caches = [ctxpar.KVCache(comm, kv_heads=2, head_dim=16, block=8) for _ in range(2)]
    for c in caches:
        c.prefill(q[:, :seq_len], k[:, :seq_len], v[:, :seq_len])
    return caches, (q, k, v)


def assert_same_answers(refused, twin, q, k, v, at):
    """The same prefill of 10 tokens from `at`, then the same decode, on both: equal bits."""
    assert refused.lengths == twin.lengths
    assert refused.local_positions() == twin.local_positions()
    sl = slice(at, at + 10)
    for a, b in zip(refused.prefill(q[:, sl], k[:, sl], v[:, sl]),
                    twin.prefill(q[:, sl], k[:, sl], v[:, sl])):
        assert torch.equal(a, b)
    new = slice(at + 10, at + 11)
    for a, b in zip(refused.decode(q[:, new], k[:, new], v[:, new]),
                    twin.decode(q[:, new], k[:, new], v[:, new])):
        assert torch.equal(a, b)


@pytest.mark.parametrize("ranks", [1, 2])
def test_decode_with_a_nan_query_stores_nothing(ranks):
    def fn(comm):
        (refused, twin), (q, k, v) = twins(comm)
        bad = q[:, 40:41].clone()
        bad[0, 0, 3, 5] = float("nan")
        with pytest.raises(ValueError) as refusal:
            refused.decode(bad, k[:, 40:41], v[:, 40:41])
        assert_same_answers(refused, twin, q, k, v, 40)  # the token was stored, then refused
        refusal.match(r"q: non-finite value \(nan\) in sequence 0, token 40, head 3, dim 5")
        return True

    assert on_threads(ranks, fn) == [True] * ranks


@pytest.mark.parametrize("which", ["k", "v", "q"])
def test_prefill_with_a_nan_in_one_ranks_rows_stores_and_sends_nothing(which):
    # Token 45 lies in block 5 (40..47): rank 1's of 2. Every rank refuses, naming rank 1.
    def fn(comm):
        (refused, twin), (q, k, v) = twins(comm)
        t = {"q": q, "k": k, "v": v}
        bad = {name: x[:, 40:50].clone() for name, x in t.items()}
        bad[which][0, 5, 1, 2] = float("nan")
        head = "head" if which == "q" else "kv head"
        with pytest.raises(ValueError) as refusal:
            refused.prefill(bad["q"], bad["k"], bad["v"],
                            mode="pass-q" if which == "q" else "pass-kv")
        assert_same_answers(refused, twin, q, k, v, 40)  # rank 1 stored and sent, then refused
        refusal.match(rf"prefill: invalid arguments on rank 1 \(of 2\): {which}: non-finite "
                      rf"value \(nan\) in sequence 0, token 45, {head} 1, dim 2")
        return True

    assert on_threads(2, fn) == [True, True]


@pytest.mark.parametrize("mask", ["none", "causal+window:4,2", ("window", -1, 5), "documents"])
def test_masks_that_see_later_tokens_are_refused_before_the_cache_exists(mask):
    def fn(comm):
        with pytest.raises(ValueError, match=r"^mask .* cannot give: it holds only the tokens "
                                             r"so far.*use causal or causal\+window:L,0"):
            ctxpar.KVCache(comm, kv_heads=1, head_dim=16, mask=mask)
        return True

    assert on_threads(1, fn) == [True]


def test_masks_that_hide_later_tokens_are_taken():
    def fn(comm):
        for mask in ("causal", ("window", 4, 0), "causal+window:4,0", ("causal+window", 4, -1)):
            ctxpar.KVCache(comm, kv_heads=1, head_dim=16, mask=mask)
        ctxpar.KVCache(comm, kv_heads=1, head_dim=16, mask="causal", documents=True)
        return True

    assert on_threads(1, fn) == [True]


def test_sequences_beyond_the_batch_range_are_refused_before_allocating():
    # 10^9 sequences allocated a shard each for 22 s, then failed; the command's --batch range
    # (MAX_BATCH = 2^20, include/ctxpar/limits.h) is refused by the argument check.
    def fn(comm):
        with pytest.raises(ValueError, match=r"sequences: must be in \[0, 1048576\], got 1048577"):
            ctxpar.KVCache(comm, kv_heads=1, head_dim=16, sequences=_checks.MAX_BATCH + 1)
        return True

    assert on_threads(1, fn) == [True]

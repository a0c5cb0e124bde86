"""Round five: the fast bf16 tier in inference (ctxpar.KVCache(..., bf16_tier="fast"): P rounded
to bfloat16 before P V in prefill's and decode's kernel calls, as GPU flash attention;
docs/kernel.md, "bf16 tiers"). Against the fp64 SDPA of the whole sequence (inference_case.py):
the fast tier within its own rule, max|fast - fp64| <= 2 max|naive fp32 - fp64| + 2^-7 max(1,
max|fp64|); the exact tier (the default, bitwise) within the exact rule plus one bf16 rounding,
and at least as accurate (mean error); float32 caches ignore the tier; a bad value, and ranks that disagree
on it, are refused naming it."""
import pytest
import torch

import ctxpar
from conftest import check_close
import inference_case as case

FAST_FLOOR = 2.0 ** -7  # twice bf16's unit roundoff (ctxpar/reference.h kFastBf16TierFloor)
MASK = "causal"
PREFILLED = 57  # sequence 0's prefill: 40 (pass-KV) + 17 (pass-Q) tokens, then decode


def rows_of(dtype, tier, ranks=2):
    """Every output row of both sequences (prefill pieces, then decode steps), rank 0's; tier
    None: the default (no bf16_tier argument)."""
    options = {} if tier is None else {"bf16_tier": tier}
    results = [None] * ranks

    def body(comm):
        results[comm.rank] = case.run(comm, MASK, dtype, **options)[::2]

    ctxpar.run_threads(ranks, body, timeout_s=60)
    for r in range(1, ranks):  # whole outputs, the same bits on every rank
        for a, b in zip(results[0][0], results[r][0]):
            assert torch.equal(a, b), f"{tier}: rank {r} differs from rank 0"
    return results[0]


def errors(rows, seqs, floor=0.0, floor_rel=None):
    """Per sequence: mean |rows - fp64|, after checking the rule on the max (floor / floor_rel:
    check_close's). The mean compares the tiers: the max is set by the bf16 rounding of the
    output, which both tiers share (measured here: max 4.84e-3 / 4.54e-3 fast against 3.88e-3 /
    4.50e-3 exact, mean 4.4e-4 / 6.0e-4 against 3.3e-4 / 4.8e-4)."""
    out = []
    for s, (got, (q, k, v, d)) in enumerate(zip(rows, seqs)):
        ok = case.mask_rule(MASK, q.shape[1], d)
        ref = case.reference(q, k, v, ok, torch.float64)
        check_close(f"sequence {s}", got.float(), ref, case.reference(q, k, v, ok, torch.float32),
                    floor, floor_rel)
        out.append((got.double() - ref).abs().mean().item())
    return out


@pytest.mark.parametrize("ranks", [1, 2])
def test_fast_tier_within_its_rule_and_exact_tier_at_least_as_accurate(ranks):
    (fast, seqs), (exact, _), (default, _) = (rows_of(torch.bfloat16, t, ranks)
                                              for t in ("fast", "exact", None))
    fast_err = errors(fast, seqs, floor_rel=FAST_FLOOR)
    exact_err = errors(exact, seqs, floor=case.STORAGE_ROUNDING[torch.bfloat16])
    for s in range(len(seqs)):
        assert exact_err[s] <= fast_err[s], (s, exact_err, fast_err)
        assert torch.equal(exact[s], default[s]), f"sequence {s}: 'exact' is not the default"
    # The tier reached the kernel of prefill (sequence 0's first rows) and of decode (its last).
    assert not torch.equal(fast[0][:, :PREFILLED], exact[0][:, :PREFILLED]), "prefill"
    assert not torch.equal(fast[0][:, PREFILLED:], exact[0][:, PREFILLED:]), "decode"


def test_float32_caches_ignore_the_tier():
    (fast, _), (exact, _) = (rows_of(torch.float32, t) for t in ("fast", "exact"))
    for a, b in zip(fast, exact):
        assert torch.equal(a, b)


def test_bad_tier_is_refused_naming_bf16_tier():
    def body(comm):
        with pytest.raises(ValueError, match=r"bf16_tier: expected one of exact, fast, got "
                                             r"'bogus'"):
            ctxpar.KVCache(comm, kv_heads=1, head_dim=16, dtype="bfloat16", bf16_tier="bogus")
        with pytest.raises(TypeError, match="bf16_tier: expected one of exact, fast"):
            ctxpar.KVCache(comm, kv_heads=1, head_dim=16, bf16_tier=None)

    ctxpar.run_threads(1, body, timeout_s=60)


def test_ranks_with_different_tiers_are_refused_naming_it():
    said = [None, None]

    def body(comm):
        cache = ctxpar.KVCache(comm, kv_heads=2, head_dim=16, dtype="bfloat16", block=8,
                               bf16_tier="fast" if comm.rank == 1 else "exact")
        q, k, v, _ = case.whole_problem([20], dtype=torch.bfloat16)[0]
        with pytest.raises(ValueError) as info:
            cache.prefill(q, k, v)
        said[comm.rank] = str(info.value)

    ctxpar.run_threads(2, body, timeout_s=60)
    want = ("prefill: the ranks were called with different arguments: bf16 tier "
            "(KvCacheOptions::kernel.bf16_tier) is exact on rank 0 but fast on rank 1")
    for s in said:
        assert want in s, s

"""ctxpar.testing.check_shards: accepts correct shards written in each convention, and points
at the rank and row of a wrong one."""
import numpy as np
import pytest
import torch

import ctxpar
from ctxpar import layout as cl
from ctxpar.testing import check_shards
from conftest import problem

T, P = 32, 4
TO = {"ring-flash-attn": (0, 1, 2, 3), "transformer-engine": (1, 0, 2, 3), "torch": (0, 2, 1, 3)}


def in_convention(x, convention):
    return np.ascontiguousarray(x.transpose(TO[convention]))


@pytest.mark.parametrize("convention", list(TO))
def test_correct_shards_pass_and_a_wrong_row_is_named(convention):
    q, k, v, _ = problem(T=T)
    out, _ = ctxpar.attention(q, k, v, mask="causal")  # one rank: the "other implementation"
    seq = {"ring-flash-attn": 1, "transformer-engine": 0, "torch": 2}[convention]
    full = [in_convention(x, convention) for x in (q, k, v, out)]
    shards = cl.shard_all(full[3], P, layout="zigzag", seq_dim=seq)
    report = check_shards(shards, *full[:3], causal=True, convention=convention)
    assert report.ok, str(report)

    # Rank 1's local row 5 holds global token zigzag(1)[5]; corrupt head 2 of batch 1 there.
    token = int(cl.positions(T, P, 1, "zigzag")[5])
    index = {"ring-flash-attn": (1, 5, 2), "transformer-engine": (5, 1, 2), "torch": (1, 2, 5)}
    shards[1][index[convention]] += 0.01
    report = check_shards(shards, *full[:3], causal=True, convention=convention)
    assert not report.ok
    assert report.worst[0] == dict(rank=1, local_row=5, token=token, batch=1, head=2,
                                   error=pytest.approx(0.01, rel=1e-3))
    assert "rank 1 local row 5" in str(report)


def test_wrong_layout_and_bf16_torch_shards():
    q, k, v, _ = (torch.from_numpy(x).bfloat16() for x in problem(T=T))
    out, _ = ctxpar.attention(q, k, v, mask="causal")
    zig = cl.shard_all(out, P, layout="zigzag", seq_dim=1)
    assert check_shards(zig, q, k, v, causal=True).ok
    contiguous = cl.shard_all(out, P, layout="contiguous", seq_dim=1)
    assert not check_shards(contiguous, q, k, v, causal=True).ok  # zigzag assumed
    assert check_shards(contiguous, q, k, v, causal=True, layout="contiguous").ok
    assert not check_shards(zig, q, k, v, causal=False).ok  # the mask matters


def test_bad_arguments():
    q, k, v, _ = problem(T=T)
    with pytest.raises(ValueError, match="convention"):
        check_shards([q], q, k, v, convention="megatron")
    with pytest.raises(ValueError, match=r"out_shards\[0\]: expected"):
        check_shards([q[:, :5], q[:, :5]], q, k, v)


def test_bound_is_the_library_rule(monkeypatch):
    """check_shards' bound is the library's accuracy_tolerance (ctxpar/reference.h), the same
    numbers as the C++ tests and `ctxpar attention --check` use."""
    from ctxpar import _ctxpar
    inf = float("inf")
    for naive, ref_max in [(1e-6, 3.0), (1e-6, 0.25), (0.0, 2.0), (inf, 2.0), (float("nan"), 2.0)]:
        want = (2 * naive if np.isfinite(naive) else 0.0) + 1e-5 * max(1.0, ref_max)
        assert _ctxpar._accuracy_tolerance(naive, ref_max) == want, (naive, ref_max)
    q, k, v, _ = problem(T=T)
    out, _ = ctxpar.attention(q, k, v, mask="causal")
    shards = cl.shard_all(out, P, layout="zigzag", seq_dim=1)
    report = check_shards(shards, q, k, v, causal=True)
    from ctxpar._attention import job_args
    ref, _ = _ctxpar._reference(q, k, v, job_args(mask="causal"))
    assert report.bound == _ctxpar._accuracy_tolerance(report.naive32_error,
                                                       float(np.abs(ref).max()))
    # A naive fp32 that overflowed says nothing about fp32: the floor alone counts (it was an
    # infinite bound, passing any finite output).
    reference = _ctxpar._reference

    def overflowed(q, k, v, args, naive32=False):
        r, lse = reference(q, k, v, args, naive32=naive32)
        if naive32:
            r = np.array(r, copy=True)
            r.flat[0] = np.inf
        return r, lse

    monkeypatch.setattr(_ctxpar, "_reference", overflowed)
    shards[1][1, 5, 2] += 0.01
    report = check_shards(shards, q, k, v, causal=True)
    assert not report.ok, str(report)
    assert report.bound < 1e-3

"""Round three: the fast bf16 tier (bf16_tier="fast": P and dS rounded to bfloat16 before P V,
dV, dK and dQ, as GPU flash attention; docs/kernel.md, "bf16 tiers") reachable from
ctxpar.attention, attention_backward and ctxpar.torch. Its rule against the fp64 autograd
reference (conftest): max|fast - fp64| <= 2 max|naive fp32 - fp64| + 2^-7 max(1, max|fp64|);
the exact tier (the default) unchanged; a bad value is refused naming bf16_tier."""
import numpy as np
import pytest
import torch

import ctxpar
from ctxpar import layout as cl
from ctxpar.torch import context_parallel, cp_attention
from conftest import check_close, problem, reference, visible

T = 128
FAST_FLOOR = 2.0 ** -7  # twice bf16's unit roundoff (docs/kernel.md, "bf16 tiers")


def bf16_problem():
    return [torch.from_numpy(x).bfloat16() for x in problem(B=1, T=T, Hq=4, Hkv=2, D=64)]


def run(tier, ranks=1, strategy="ring", **extra):
    """(out, lse, dq, dk, dv) of the causal bf16 problem on `ranks` ranks; tier None: the
    default (no bf16_tier argument)."""
    q, k, v, dout = bf16_problem()
    opts = dict(ranks=ranks, strategy=strategy, mask="causal", **extra)
    if tier is not None:
        opts["bf16_tier"] = tier
    out, lse = ctxpar.attention(q, k, v, **opts)
    return (out, lse, *ctxpar.attention_backward(q, k, v, out, lse, dout, **opts))


@pytest.mark.parametrize("ranks, strategy", [(1, "ring"), (2, "ring"), (2, "allgather")])
def test_fast_tier_within_its_rule_and_exact_tier_unchanged(ranks, strategy):
    q, k, v, dout = bf16_problem()
    ok = visible(T, "causal")
    ref = reference(q.float(), k.float(), v.float(), dout.float(), ok)
    naive = reference(q.float(), k.float(), v.float(), dout.float(), ok, dtype=torch.float32)
    fast, exact, default = (run(tier, ranks, strategy) for tier in ("fast", "exact", None))
    names = ["out", "lse", "dq", "dk", "dv"]
    for name, f, r, n in zip(names, fast, ref, naive):
        assert f.dtype == (torch.float32 if name == "lse" else torch.bfloat16)
        check_close(name, f, r, n, floor_rel=FAST_FLOOR)
    for name, e, d in zip(names, exact, default):
        assert torch.equal(e, d), f"{name}: bf16_tier='exact' is not the default"
    # l sums the fp32 P in both tiers: the LSE is the same; the rounded products are not.
    assert torch.equal(fast[1], exact[1])
    for name, f, e in zip(names[2:], fast[2:], exact[2:]):
        assert not torch.equal(f, e), f"{name}: the fast tier did not reach the kernel"


# Ulysses (and hybrid, here one Ulysses group of 2) computes each head over the whole sequence
# in one rank's kernel, as one rank does: bitwise the same, in either tier. (Ring and
# all-gather merge or order key blocks differently, so they are within the rule instead.)
@pytest.mark.parametrize("strategy", ["ulysses", "hybrid"])
def test_fast_tier_on_two_ranks_is_one_rank_bitwise(strategy):
    one, two = run("fast"), run("fast", ranks=2, strategy=strategy)
    for name, a, b in zip(["out", "lse", "dq", "dk", "dv"], one, two):
        assert torch.equal(a, b), f"{name}: ranks=2 ({strategy}) differs from ranks=1"


def test_float32_inputs_ignore_the_tier():
    q, k, v, _ = problem(T=32)
    fast, _ = ctxpar.attention(q, k, v, ranks=2, mask="causal", bf16_tier="fast")
    exact, _ = ctxpar.attention(q, k, v, ranks=2, mask="causal")
    assert np.array_equal(fast, exact)


def test_cp_attention_and_context_parallel_take_the_tier():
    # Two thread ranks, zigzag ring: cp_attention's autograd (forward and backward) on the
    # fast tier gives ctxpar.attention's fast-tier answer on the same ranks, bitwise; the
    # context_parallel block routes SDPA with the same tier.
    q, k, v, dout = bf16_problem()
    want = run("fast", ranks=2, layout="zigzag")

    def rank(comm):
        qs, ks, vs, gs = (cl.shard(x, comm, layout="zigzag", seq_dim=1) for x in (q, k, v, dout))
        qs, ks, vs = (x.clone().requires_grad_() for x in (qs, ks, vs))
        out = cp_attention(qs, ks, vs, comm=comm, causal=True, bf16_tier="fast")
        out.backward(gs)
        buffers = [x.transpose(1, 2).contiguous() for x in (q, k, v)]  # [B, H, T, D]
        with context_parallel(comm, buffers=buffers, buffer_seq_dims=[2, 2, 2],
                              bf16_tier="fast"):
            routed = torch.nn.functional.scaled_dot_product_attention(*buffers, is_causal=True,
                                                                     enable_gqa=True)
        return out.detach(), qs.grad, ks.grad, vs.grad, routed.transpose(1, 2)

    results = [None] * 2
    ctxpar.run_threads(2, lambda comm: results.__setitem__(comm.rank, rank(comm)))
    got = [cl.unshard_all([r[i] for r in results], layout="zigzag") for i in range(5)]
    for name, g, w in zip(["out", "dq", "dk", "dv", "sdpa out"], got, [want[0], *want[2:],
                                                                       want[0]]):
        assert torch.equal(g, w), f"{name}: not the fast tier's answer"


@pytest.mark.parametrize("call", ["attention", "attention_backward", "cp_attention",
                                  "context_parallel"])
def test_bad_tier_is_refused_naming_bf16_tier(call):
    q, k, v, dout = (torch.from_numpy(x) for x in problem(T=32))
    lse = torch.zeros(2, 4, 32)

    def rank(comm):
        with pytest.raises(ValueError, match=r"bf16_tier: expected one of exact, fast, got "
                                             r"'bogus'"):
            if call == "attention":
                ctxpar.attention(q, k, v, bf16_tier="bogus")
            elif call == "attention_backward":
                ctxpar.attention_backward(q, k, v, q, lse, dout, bf16_tier="bogus")
            elif call == "cp_attention":
                cp_attention(q, k, v, comm=comm, bf16_tier="bogus")
            else:
                with context_parallel(comm, buffers=[q], buffer_seq_dims=[1],
                                      bf16_tier="bogus"):
                    pass

    ctxpar.run_threads(1, rank)
    with pytest.raises(TypeError, match="bf16_tier: expected one of exact, fast"):
        ctxpar.attention(q, k, v, bf16_tier=True)


def test_cp_attention_ranks_with_different_tiers_are_refused_naming_it():
    q, k, v, _ = (torch.from_numpy(x).bfloat16() for x in problem(T=32))
    said = [None, None]

    def rank(comm):
        local = [cl.shard(x, comm, seq_dim=1) for x in (q, k, v)]
        with pytest.raises(ValueError) as info:
            cp_attention(*local, comm, bf16_tier="fast" if comm.rank == 0 else "exact")
        said[comm.rank] = str(info.value)

    ctxpar.run_threads(2, rank, timeout_s=60)
    assert said == ["cp_attention: the ranks were called with different arguments: bf16_tier is "
                    "fast on rank 0 but exact on rank 1; every rank of the communicator must "
                    "pass the same"] * 2

"""ctxpar.torch.context_parallel with layout="balanced" on packed documents (issue 37): the block
shards by the balanced layout of causal attention within the documents (solved once, agreed
across ranks), its SDPA matches the fp64 reference of the per-document mask under the
project's rule, buffers and context_parallel_unshard round-trip bit for bit, and what would be
silently wrong is refused: no documents, different documents on two ranks, attention that is
not causal. Every rank is a thread (ctxpar.run_threads)."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import ctxpar
from ctxpar import layout as cl
from ctxpar.torch import context_parallel, context_parallel_unshard
from conftest import check_close, problem, reference, visible
from test_torch import run_ranks

pytestmark = pytest.mark.skipif(not hasattr(F, "scaled_dot_product_attention"),
                                reason="torch < 2.0: no scaled_dot_product_attention to route")

# Packed documents of uneven lengths (T = 64): the balanced layout of causal attention within
# them is neither contiguous nor zigzag (checked below, or the tests would prove nothing new).
CU_SEQLENS = [0, 5, 35, 44, 64]
T = CU_SEQLENS[-1]
DOCS = torch.repeat_interleave(torch.arange(len(CU_SEQLENS) - 1),
                               torch.tensor(np.diff(CU_SEQLENS)))


def balanced_permutation(ranks):
    """The balanced layout's permutation of DOCS, from ctxpar.layout (what cp_attention and
    ctxpar.layout.shard use), checked to be no fixed layout's."""
    perm, _ = cl.permutation(T, ranks, "balanced", mask="causal", document_ids=DOCS)
    for fixed in ("contiguous", "zigzag", "striped"):
        assert not np.array_equal(perm, cl.permutation(T, ranks, fixed)[0]), fixed
    return perm


@pytest.mark.parametrize("ranks", [2, 4])
def test_sdpa_in_a_balanced_block_matches_fp64_with_the_documents_mask(ranks):
    """Causal SDPA inside the block attends within the documents: out (unsharded) and the
    leaves' gradients (whole on exit) against the fp64 autograd reference of causal + documents,
    fp32 as the naive run; the block's shards are the balanced permutation's."""
    q, k, v, dout = problem(B=1, T=T, Hq=4, Hkv=2, D=16)
    whole = [torch.from_numpy(x).transpose(1, 2).contiguous() for x in (q, k, v, dout)]
    perm = balanced_permutation(ranks)
    Tl = T // ranks

    def rank(comm):
        bufs = [x.clone().requires_grad_() for x in whole[:3]]
        grad = whole[3].clone()
        with context_parallel(comm, buffers=bufs + [grad], buffer_seq_dims=[2] * 4,
                              layout="balanced", cu_seqlens=CU_SEQLENS):
            mine = perm[comm.rank * Tl:(comm.rank + 1) * Tl]
            assert torch.equal(bufs[0].detach(), whole[0][:, :, mine])
            out = F.scaled_dot_product_attention(*bufs, is_causal=True, enable_gqa=True)
            out.backward(grad)
            shard = out.detach()
        full = context_parallel_unshard(comm, [shard], [2], layout="balanced",
                                        cu_seqlens=CU_SEQLENS)[0]
        return [full] + [b.grad for b in bufs]

    ok = visible(T, "causal", DOCS)
    ref = reference(q, k, v, dout, ok)
    naive = reference(q, k, v, dout, ok, dtype=torch.float32)
    for r, got in enumerate(run_ranks(ranks, rank)):
        for name, x, i in (("out", got[0], 0), ("dq", got[1], 2), ("dk", got[2], 3),
                           ("dv", got[3], 4)):
            check_close(f"rank {r} {name}", x.transpose(1, 2), ref[i], naive[i])


def test_balanced_block_and_unshard_round_trip_bitwise():
    """Buffers come back bit for bit (seq dims 1 and 2, bfloat16 too), and
    context_parallel_unshard of the block's shards is the whole tensor, on 3 ranks."""
    ranks, docs = 3, torch.tensor([0] * 7 + [1] * 30 + [2] * 11)  # T = 48
    torch.manual_seed(0)
    a = torch.randn(2, 48, 3)
    b = torch.randn(1, 2, 48, 4).to(torch.bfloat16)

    def rank(comm):
        x, y = a.clone(), b.clone()
        with context_parallel(comm, buffers=[x, y], buffer_seq_dims=[1, 2], layout="balanced",
                              document_ids=docs):
            shards = [x.clone(), y.clone()]
        back = context_parallel_unshard(comm, shards, [1, -2], layout="balanced",
                                        document_ids=docs)
        return x, y, back

    for x, y, (ua, ub) in run_ranks(ranks, rank):
        assert torch.equal(x, a) and torch.equal(y, b)
        assert torch.equal(ua, a) and torch.equal(ub, b)


def test_balanced_without_documents_is_refused_saying_what_to_pass():
    """The balanced layout of one document would differ from the one cp_attention balances:
    refused before any buffer changes, naming document_ids= and cu_seqlens=."""
    x = torch.arange(T, dtype=torch.float32).reshape(1, T)

    def rank(comm):
        buf = x.clone()
        with pytest.raises(ValueError, match="balances causal attention within packed") as e:
            with context_parallel(comm, buffers=[buf], buffer_seq_dims=[1], layout="balanced"):
                pass
        assert torch.equal(buf, x)
        with pytest.raises(ValueError, match="balances causal attention within packed"):
            context_parallel_unshard(comm, [buf[:, :T // 2]], [1], layout="balanced")
        return str(e.value)

    for message in run_ranks(2, rank):
        assert "document_ids=" in message and "cu_seqlens=" in message, message


def test_ranks_with_different_documents_are_refused_naming_the_field():
    """Each rank would shard by its own documents' layout (tokens twice, or nowhere): every
    rank raises the agreement's ValueError naming document_ids, buffers untouched; a rank that
    refuses its own arguments is named to the others, which do not wait for it."""
    x = torch.arange(T, dtype=torch.float32).reshape(1, T)
    other = torch.tensor([0] * 40 + [1] * 24)

    def rank(comm):
        buf = x.clone()
        with pytest.raises(ValueError) as differ:
            with context_parallel(comm, buffers=[buf], buffer_seq_dims=[1], layout="balanced",
                                  document_ids=DOCS if comm.rank == 0 else other):
                pass
        assert torch.equal(buf, x)
        ids = DOCS if comm.rank == 0 else DOCS[:32]  # rank 1: one id per token of half
        with pytest.raises(ValueError) as local:
            with context_parallel(comm, buffers=[buf], buffer_seq_dims=[1], layout="balanced",
                                  document_ids=ids):
                pass
        assert torch.equal(buf, x)
        return str(differ.value), str(local.value)

    (differ0, local0), (differ1, local1) = run_ranks(2, rank)
    assert differ0 == differ1, (differ0, differ1)
    assert differ0.startswith("context_parallel: the ranks were called with different "
                              "arguments: document_ids is 64 ints"), differ0
    assert local1.startswith("document_ids: 32 ids for a sequence of 64 tokens"), local1
    assert "rank 1" in local0 and "document_ids: 32 ids" in local0, local0


def test_attention_that_is_not_causal_is_refused_in_a_balanced_block():
    """The block's layout balances causal attention: SDPA without is_causal is refused, named."""
    q = torch.randn(1, 2, T, 8)

    def rank(comm):
        buf = q.clone()
        with context_parallel(comm, buffers=[buf], buffer_seq_dims=[2], layout="balanced",
                              document_ids=DOCS):
            with pytest.raises(ValueError, match="is_causal=False"):
                F.scaled_dot_product_attention(buf, buf, buf)
        return True

    assert all(run_ranks(2, rank))


def test_a_rank_with_another_layout_is_named_not_waited_for():
    """Rank 0 balanced (agreeing on entry), rank 1 zigzag (agreeing in its first attention):
    both raise a ValueError naming the layouts, within the threads' timeout."""
    q = torch.randn(1, 2, T, 8)

    def rank(comm):
        buf = q.clone()
        with pytest.raises(ValueError) as e:
            with context_parallel(comm, buffers=[buf], buffer_seq_dims=[2], document_ids=DOCS,
                                  layout="balanced" if comm.rank == 0 else "zigzag"):
                F.scaled_dot_product_attention(buf, buf, buf, is_causal=True)
        return str(e.value)

    for message in run_ranks(2, rank):
        assert "layout is balanced on rank 0 but zigzag on rank 1" in message, message

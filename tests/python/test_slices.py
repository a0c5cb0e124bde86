"""Issue 37 in Python: slice masks (a list of slices, a prefix tree), cu_seqlens, and the
balanced layout, on whole tensors and per rank, against the fp64 autograd reference of a
visibility matrix written here from the slices' definition (docs/kernel.md, "Slice masks")."""
import numpy as np
import pytest
import torch

import ctxpar
from ctxpar import layout as cl
from ctxpar.torch import cp_attention
from conftest import check_close, problem, reference, visible

T = 96


def sliced(T, slices):
    """[T, T] bool from slices (q_range, k_range, type): query q sees key k iff some slice has q
    in its q range, k in its k range and, when causal, k - k_end <= q - q_end."""
    ok = torch.zeros(T, T, dtype=torch.bool)
    for (qa, qb), (ka, kb), kind in slices:
        for q in range(qa, qb):
            for k in range(ka, kb):
                ok[q, k] |= kind == "full" or k - kb <= q - qb
    return ok


TREE = [((0, 32), (0, 32), "causal")] + [
    s for a, b in ((32, 56), (56, 80), (80, 96))
    for s in (((a, b), (0, 32), "full"), ((a, b), (a, b), "causal"))]
SINKS = [((0, 96), (0, 4), "full"), ((10, 60), (5, 40), "causal"), ((50, 96), (40, 90), "full")]
CU = np.array([0, 40, 45, 70, 96])


@pytest.mark.parametrize("case", ["tuples", "dicts", "prefix-tree", "cu_seqlens"])
@pytest.mark.parametrize("ranks, layout, strategy", [
    (1, "balanced", "ring"), (4, "balanced", "ring"), (3, "balanced", "allgather"),
    (4, "balanced", "ulysses"), (4, "striped", "ring")])
def test_slice_masks_and_documents_match_fp64(case, ranks, layout, strategy):
    q, k, v, dout = problem(T=T)
    if case == "tuples":
        opts, ok = dict(mask=SINKS), sliced(T, SINKS)
    elif case == "dicts":
        mask = [{"q": list(a), "k": list(b), "type": t} for a, b, t in TREE]
        opts, ok = dict(mask=mask), sliced(T, TREE)
    elif case == "prefix-tree":
        opts, ok = dict(mask="prefix-tree:32,24,24,16"), sliced(T, TREE)
    else:
        ids = np.repeat(np.arange(4), np.diff(CU)).astype(np.int32)
        opts, ok = dict(mask="causal", cu_seqlens=CU), visible(T, "causal", ids)
    ref = reference(q, k, v, dout, ok)
    naive = reference(q, k, v, dout, ok, dtype=torch.float32)
    opts.update(ranks=ranks, layout=layout, strategy=strategy)
    out, lse = ctxpar.attention(q, k, v, **opts)
    grads = ctxpar.attention_backward(q, k, v, out, lse, dout, **opts)
    for name, ours, r, n in zip(["out", "lse", "dq", "dk", "dv"], [out, lse, *grads], ref, naive):
        check_close(name, ours, r, n)


def test_balanced_permutation_shards_and_restores():
    ids = ctxpar.document_ids_from_cu_seqlens(CU * 4)  # T = 384
    tokens, ranks = 384, 4
    perm, inverse = cl.permutation(tokens, ranks, "balanced", mask="causal", document_ids=ids)
    assert sorted(perm.tolist()) == list(range(tokens))
    assert (perm[inverse] == np.arange(tokens)).all()
    x = np.arange(tokens) * 10
    shards = cl.shard_all(x, ranks, layout="balanced", seq_dim=0, mask="causal", document_ids=ids)
    assert (np.concatenate(shards) == x[perm]).all()
    assert (cl.unshard_all(shards, layout="balanced", seq_dim=0, mask="causal",
                           document_ids=ids) == x).all()
    # cu_seqlens and document ids give the same layout; the mask is what it balances.
    same = cl.permutation(tokens, ranks, "balanced", mask="causal", cu_seqlens=CU * 4)[0]
    assert (same == perm).all()


def test_cp_attention_on_the_balanced_layout_matches_fp64():
    tokens, ranks = 512, 4
    cu = np.array([0, 300, 340, 400, 512])
    ids = ctxpar.document_ids_from_cu_seqlens(cu)
    q, k, v, dout = problem(T=tokens, B=1, Hq=2, Hkv=1)
    ok = visible(tokens, "causal", ids)
    ref = reference(q, k, v, dout, ok)
    naive = reference(q, k, v, dout, ok, dtype=torch.float32)
    full = [torch.from_numpy(x) for x in (q, k, v, dout)]
    bal = dict(mask="causal", document_ids=ids)
    outs = [None] * ranks

    def rank(comm):
        qs, ks, vs, gs = (cl.shard(x, comm, layout="balanced", seq_dim=1, **bal) for x in full)
        qs, ks, vs = (x.clone().requires_grad_() for x in (qs, ks, vs))
        out = cp_attention(qs, ks, vs, comm=comm, layout="balanced", **bal)
        (out * gs).sum().backward()
        outs[comm.rank] = [out.detach(), qs.grad, ks.grad, vs.grad]

    ctxpar.run_threads(ranks, rank)
    for i, name in enumerate(["out", "dq", "dk", "dv"]):
        whole = cl.unshard_all([o[i] for o in outs], layout="balanced", seq_dim=1, **bal)
        check_close(name, whole, ref[0 if i == 0 else i + 1], naive[0 if i == 0 else i + 1])


@pytest.mark.parametrize("bad, what", [
    (dict(mask=[((0, 8), (0, 8), "diagonal")]), "type must be 'full' or 'causal'"),
    (dict(mask=[((8, 0), (0, 8), "full")]), "not two non-empty ranges"),
    (dict(mask=[{"q": [0, 8], "k": [0, 8], "type": "full", "w": 1}]), "unknown keys"),
    (dict(mask="causal", cu_seqlens=[0, 50, 40, 96]), "increase strictly"),
    (dict(mask="causal", cu_seqlens=[0, 50, 90]), r"one entry per token \(96\), got 90"),
    (dict(mask="causal", cu_seqlens=CU, document_ids=np.zeros(T, np.int32)), "not both"),
])
def test_bad_slices_and_cu_seqlens_are_named(bad, what):
    q, k, v, _ = problem(T=T)
    with pytest.raises(ValueError, match=what):
        ctxpar.attention(q, k, v, ranks=2, **bad)


def test_balanced_sharding_without_the_mask_is_refused():
    # The attention balances the mask it is given; a shard made without it would put tokens
    # where the attention does not look for them.
    with pytest.raises(ValueError, match="pass the mask= and document_ids="):
        cl.positions(256, 4, 0, "balanced")
    with pytest.raises(ValueError, match="pass the mask= and document_ids="):
        cl.shard(np.zeros((1, 256, 2, 16), np.float32), rank=0, ranks=4, layout="balanced")
    assert len(cl.positions(256, 4, 0, "balanced", mask="causal")) == 64

"""ctxpar.attention / attention_backward on whole tensors against the fp64 autograd reference,
for every strategy x layout x mask on 1, 2 and 4 in-process ranks."""
import numpy as np
import pytest
import torch

import ctxpar
from conftest import check_close, problem, reference, visible

T = 32
DOCS = np.repeat([0, 1, 2], [10, 14, 8]).astype(np.int32)
MASKS = {"none": ("none", None), "causal": ("causal", None), "window": (("window", 6, 3), None),
         "documents": ("causal", DOCS)}


@pytest.mark.parametrize("ranks", [1, 2, 4])
@pytest.mark.parametrize("mask_name", list(MASKS))
@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
@pytest.mark.parametrize("strategy", ["ring", "allgather", "ulysses", "hybrid"])
def test_forward_backward_match_fp64(strategy, layout, mask_name, ranks):
    mask, docs = MASKS[mask_name]
    q, k, v, dout = problem(T=T)
    ok = visible(T, mask, docs)
    ref = reference(q, k, v, dout, ok)
    naive = reference(q, k, v, dout, ok, dtype=torch.float32)
    opts = dict(ranks=ranks, strategy=strategy, layout=layout, mask=mask, document_ids=docs,
                ulysses_degree=2 if strategy == "hybrid" and ranks >= 2 else 0)
    out, lse = ctxpar.attention(q, k, v, **opts)
    grads = ctxpar.attention_backward(q, k, v, out, lse, dout, **opts)
    for name, ours, r, n in zip(["out", "lse", "dq", "dk", "dv"], [out, lse, *grads], ref, naive):
        check_close(name, ours, r, n)


def test_torch_tensors_come_back_as_torch():
    q, k, v, dout = (torch.from_numpy(x) for x in problem())
    out, lse = ctxpar.attention(q, k, v, ranks=2, mask="causal")
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
    assert lse.shape == (2, 4, T) and lse.dtype == torch.float32
    dq, dk, dv = ctxpar.attention_backward(q, k, v, out, lse, dout, ranks=2, mask="causal")
    assert dq.shape == q.shape and dk.shape == k.shape and isinstance(dv, torch.Tensor)


def test_tensors_requiring_grad_are_read_without_detaching_by_hand():
    q, k, v, _ = (torch.from_numpy(x).requires_grad_() for x in problem())
    out = ctxpar.attention(q, k, v, ranks=2, return_lse=False)
    assert out.shape == q.shape and not out.requires_grad


def test_bf16_matches_fp64_of_the_rounded_inputs():
    q, k, v, dout = (torch.from_numpy(x).bfloat16() for x in problem())
    ok = visible(T, "causal")
    ref = reference(q.float(), k.float(), v.float(), dout.float(), ok)
    naive = reference(q.float(), k.float(), v.float(), dout.float(), ok, dtype=torch.float32)
    out, lse = ctxpar.attention(q, k, v, ranks=4, mask="causal")
    assert out.dtype == torch.bfloat16
    # bf16 storage: one rounding of the result (2^-8 relative) on top of the fp32 rule.
    check_close("out", out, ref[0], naive[0], floor=2 ** -8)
    check_close("lse", lse, ref[1], naive[1])
    grads = ctxpar.attention_backward(q, k, v, out, lse, dout, ranks=4, mask="causal")
    for name, g, r, n in zip(["dq", "dk", "dv"], grads, ref[2:], naive[2:]):
        assert g.dtype == torch.bfloat16
        # bf16 out and dout enter delta = rowsum(dout * out): the attention check's floor 2^-7.
        check_close(name, g, r, n, floor=2 ** -7)


def test_fp16_is_widened_and_the_result_narrowed():
    q, k, v, _ = (x.astype(np.float16) for x in problem())
    out, lse = ctxpar.attention(q, k, v, ranks=2, mask="causal")
    assert out.dtype == np.float16 and lse.dtype == np.float32
    want, _ = ctxpar.attention(*(x.astype(np.float32) for x in (q, k, v)), ranks=2,
                               mask="causal")
    assert np.array_equal(out, want.astype(np.float16))


def test_positions_are_the_mask_positions():
    # Two sequences packed back to back, positions restarting: with causal + documents this
    # equals each sequence alone.
    q, k, v, dout = problem(T=T)
    pos = np.concatenate([np.arange(16), np.arange(16)])
    docs = np.repeat([0, 1], 16).astype(np.int32)
    out, _ = ctxpar.attention(q, k, v, ranks=2, mask="causal", positions=pos, document_ids=docs)
    ref = reference(q, k, v, dout, visible(T, "causal", docs, pos))
    naive = reference(q, k, v, dout, visible(T, "causal", docs, pos), dtype=torch.float32)
    check_close("out", out, ref[0], naive[0])


def test_strided_views_are_read_in_place():
    # q as a view with head stride 2 (every other head of a bigger array): last dim contiguous.
    q, k, v, _ = problem(Hq=8)
    k, v = k[:, :, :1], v[:, :, :1]  # views: Hkv = 1 (MQA)
    q_view = q[:, :, ::2]
    assert not q_view.flags.c_contiguous
    out, _ = ctxpar.attention(q_view, k, v, ranks=2, mask="causal")
    want, _ = ctxpar.attention(np.ascontiguousarray(q_view), np.ascontiguousarray(k),
                               np.ascontiguousarray(v), ranks=2, mask="causal")
    assert np.array_equal(out, want)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
@pytest.mark.parametrize("strategy", ["ring", "allgather", "ulysses", "hybrid"])
def test_any_length_is_padded_internally(strategy, layout):
    # T = 29 divides by no layout's granule for 4 ranks: padding tokens are added inside and
    # never reach the results, which match the fp64 reference of the 29 real tokens.
    T29 = 29
    docs = np.repeat([0, 1, 2], [9, 13, 7]).astype(np.int32)
    q, k, v, dout = problem(T=T29)
    ok = visible(T29, "causal", docs)
    ref = reference(q, k, v, dout, ok)
    naive = reference(q, k, v, dout, ok, dtype=torch.float32)
    opts = dict(ranks=4, strategy=strategy, layout=layout, mask="causal", document_ids=docs,
                ulysses_degree=2 if strategy == "hybrid" else 0)
    out, lse = ctxpar.attention(q, k, v, **opts)
    assert out.shape == q.shape and lse.shape == (2, 4, T29)
    grads = ctxpar.attention_backward(q, k, v, out, lse, dout, **opts)
    for name, ours, r, n in zip(["out", "lse", "dq", "dk", "dv"], [out, lse, *grads], ref, naive):
        check_close(name, ours, r, n)


def test_per_rank_shards_that_a_layout_cannot_cut_are_refused():
    with pytest.raises(ValueError, match="needs T % 2P == 0"):
        ctxpar.layout.positions(30, 4, 0, layout="zigzag")

"""ctxpar.torch on in-process ranks: cp_attention's gradients (autograd) against the fp64
reference, gradcheck, and the context_parallel block (restores buffers and SDPA, also on
exceptions). Every rank is a thread (ctxpar.run_threads); cp_attention releases the GIL while
it communicates, or these tests would deadlock."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import ctxpar
from ctxpar import layout as cl
from ctxpar.torch import context_parallel, cp_attention
from conftest import check_close, problem, reference, visible

T = 32


def run_ranks(ranks, fn):
    """fn(comm) on `ranks` threads; returns the per-rank results in rank order."""
    results = [None] * ranks

    def body(comm):
        results[comm.rank] = fn(comm)

    ctxpar.run_threads(ranks, body)
    return results


@pytest.mark.parametrize("ranks, layout, strategy", [
    (1, "zigzag", "ring"), (2, "zigzag", "ring"), (4, "zigzag", "ring"),
    (4, "contiguous", "allgather"), (4, "striped", "ulysses"), (2, "zigzag", "hybrid")])
def test_cp_attention_gradients_match_fp64(ranks, layout, strategy):
    q, k, v, dout = problem(T=T)
    full = [torch.from_numpy(x) for x in (q, k, v, dout)]

    def rank(comm):
        qs, ks, vs, gs = (cl.shard(x, comm, layout=layout, seq_dim=1) for x in full)
        qs, ks, vs = (x.clone().requires_grad_() for x in (qs, ks, vs))
        out = cp_attention(qs, ks, vs, comm=comm, layout=layout, causal=True, strategy=strategy)
        (out * gs).sum().backward()
        return out.detach(), qs.grad, ks.grad, vs.grad

    per_rank = run_ranks(ranks, rank)
    ours = [cl.unshard_all([r[i] for r in per_rank], layout=layout) for i in range(4)]
    ok = visible(T, "causal")
    ref, naive = reference(q, k, v, dout, ok), reference(q, k, v, dout, ok, dtype=torch.float32)
    for name, o, r, n in zip(["out", "dq", "dk", "dv"], ours, [ref[0]] + ref[2:],
                             [naive[0]] + naive[2:]):
        check_close(name, o, r, n)



@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_cp_attention_with_document_ids_in_a_compiled_function_runs_eagerly(backend):
    # torch.compile traced into cp_attention and crashed in Dynamo (a DLDeviceType constant from
    # the DLPack exchange). Without arrays it is one op now (tests/python/test_compile.py); with
    # document_ids, which a graph would keep as constants for the next batch, it is a graph
    # break: the attention runs eagerly, the code around it compiled, and the result and
    # gradients are those of the uncompiled function, bit for bit.
    torch.manual_seed(3)
    x0 = torch.randn(1, 32, 2, 16)
    w = torch.randn(16, 16) / 4
    docs = [0] * 12 + [1] * 20

    def step(comm, x, compiled):
        def f(x):
            q = (x @ w).tanh()
            return (cp_attention(q, x, x, comm, mask="causal", document_ids=docs) * 1.5).sum()
        fn = torch.compile(f, backend=backend) if compiled else f
        x = cl.shard(x0, comm, seq_dim=1).clone().requires_grad_(True)
        loss = fn(x)
        loss.backward()
        return loss.detach(), x.grad

    def rank(comm):
        return step(comm, x0, False), step(comm, x0, True)

    for (loss, grad), (loss_c, grad_c) in run_ranks(2, rank):
        assert torch.equal(loss, loss_c) and torch.equal(grad, grad_c)

    def fullgraph(comm):
        x = cl.shard(x0, comm, seq_dim=1)
        with pytest.raises(Exception, match="document_ids or positions runs eagerly"):
            torch.compile(lambda x: cp_attention(x, x, x, comm, document_ids=docs),
                          backend=backend, fullgraph=True)(x)
        return True

    assert all(run_ranks(2, fullgraph))


def test_gradcheck_on_the_fp32_kernel():
    # On one rank: with P > 1 a rank's backward returns dK/dV summed over every rank's dout,
    # so a per-rank Jacobian (what gradcheck builds) does not exist; the distributed gradients
    # are the fp64 reference test above.
    # ctxpar computes in fp32 only, so gradcheck runs on an fp64 wrapper that casts to fp32.
    # The finite differences then carry fp32 rounding: a central difference with step eps has
    # error ~ 2^-24 * max|f| / eps, ~1e-4 at eps = 1e-3 for |f| ~ 1, hence atol = rtol = 1e-2.
    # Loose, but a wrong backward (a missing scale, a transposed head, a lost rank's share)
    # is off by O(1). The exact check is the fp64 reference test above.
    q, k, v, _ = problem(B=1, T=8, Hq=2, Hkv=1, D=16)
    inputs = [torch.from_numpy(x).double().requires_grad_() for x in (q, k, v)]

    def rank(comm):
        def f(q, k, v):
            parts = [cl.shard(x, comm, layout="zigzag", seq_dim=1).float() for x in (q, k, v)]
            return cp_attention(*parts, comm=comm, causal=True).double()
        return torch.autograd.gradcheck(f, inputs, eps=1e-3, atol=1e-2, rtol=1e-2,
                                        check_undefined_grad=False)

    assert all(run_ranks(1, rank))


def test_cp_attention_bf16_and_fp16_keep_their_dtype():
    q, k, v, _ = problem(T=T)

    def rank(comm):
        got = []
        for dt in (torch.bfloat16, torch.float16):
            xs = [cl.shard(torch.from_numpy(x), comm, seq_dim=1).to(dt).requires_grad_()
                  for x in (q, k, v)]
            out = cp_attention(*xs, comm=comm, causal=True)
            out.float().sum().backward()
            got.append((out.dtype, xs[0].grad.dtype))
        return got

    for got in run_ranks(2, rank):
        assert got == [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16)]


def test_cp_attention_bad_arguments():
    q, k, v, _ = (torch.from_numpy(x) for x in problem(T=T))
    with pytest.raises(TypeError, match="comm: expected a ctxpar.Communicator"):
        cp_attention(q, k, v, comm=None)
    with pytest.raises(TypeError, match=r"mesh: expected a torch DeviceMesh \(1-D, e.g. "
                                        r"mesh\['cp'\]\) or a ctxpar.Communicator, got str"):
        with context_parallel("cp", buffers=[q], buffer_seq_dims=[1]):
            pass

    def rank(comm):
        with pytest.raises(ValueError, match="k: shape"):
            cp_attention(q, k[:, :8], v, comm=comm)
        return True

    assert all(run_ranks(2, rank))


def test_an_exception_on_one_rank_is_raised_as_itself_and_others_do_not_hang():
    def rank(comm):
        if comm.rank == 1:
            raise KeyError("boom on rank 1")
        comm.barrier()  # fails promptly: rank 1 is gone

    with pytest.raises(KeyError, match="boom on rank 1"):
        ctxpar.run_threads(2, rank, timeout_s=30)


def test_communicator_used_after_its_block_is_refused():
    kept = run_ranks(1, lambda comm: comm)
    with pytest.raises(ValueError, match="run_threads block has ended"):
        kept[0].rank


def test_context_parallel_shards_routes_sdpa_and_restores():
    # The seeds' example: [B, H, T, D] buffers, seq dim 2, SDPA with is_causal inside.
    q, k, v, _ = problem(T=T)
    full = [torch.from_numpy(x).transpose(1, 2).contiguous() for x in (q, k, v)]
    sdpa_before = getattr(F, "scaled_dot_product_attention", None)

    def rank(comm):
        bufs = [x.clone().requires_grad_() for x in full]
        ids = [id(b) for b in bufs]
        with context_parallel(comm, buffers=bufs, buffer_seq_dims=[2, 2, 2]):
            assert bufs[0].shape[2] == T // comm.size  # sharded in place
            out = F.scaled_dot_product_attention(*bufs, is_causal=True, enable_gqa=True)
        assert [id(b) for b in bufs] == ids
        assert all(torch.equal(b, x) for b, x in zip(bufs, full))  # restored
        return out.detach().transpose(1, 2)

    out = cl.unshard_all(run_ranks(2, rank), layout="zigzag")
    assert getattr(F, "scaled_dot_product_attention", None) is sdpa_before
    ok = visible(T, "causal")
    ref, naive = reference(q, k, v, q, ok), reference(q, k, v, q, ok, dtype=torch.float32)
    check_close("out", out, ref[0], naive[0])


@pytest.mark.skipif(not hasattr(F, "scaled_dot_product_attention"),
                    reason="torch < 2.0 has no scaled_dot_product_attention to bind")
def test_context_parallel_routes_sdpa_bound_to_another_name_before_the_block():
    # `from torch.nn.functional import scaled_dot_product_attention` at a model's import: the
    # block must route that name too, or each rank silently attends to its own tokens only.
    from torch.nn.functional import scaled_dot_product_attention as bound
    q, k, v, _ = problem(T=T)
    full = [torch.from_numpy(x).transpose(1, 2).contiguous() for x in (q, k, v)]

    def rank(comm):
        bufs = [x.clone() for x in full]
        with context_parallel(comm, buffers=bufs, buffer_seq_dims=[2, 2, 2]):
            out = bound(*bufs, is_causal=True, enable_gqa=True)
        return out.transpose(1, 2)

    out = cl.unshard_all(run_ranks(2, rank), layout="zigzag")
    ok = visible(T, "causal")
    ref, naive = reference(q, k, v, q, ok), reference(q, k, v, q, ok, dtype=torch.float32)
    check_close("out", out, ref[0], naive[0])


def test_context_parallel_restores_on_exceptions():
    x = torch.arange(2 * 8, dtype=torch.float32).reshape(1, 2, 8, 1).repeat(1, 1, 1, 16)
    sdpa_before = getattr(F, "scaled_dot_product_attention", None)

    def rank(comm):
        buf = x.clone()
        with pytest.raises(RuntimeError, match="inside the block"):
            with context_parallel(comm, buffers=[buf], buffer_seq_dims=[2]):
                raise RuntimeError("inside the block")
        assert torch.equal(buf, x)
        with pytest.raises(ValueError, match="attn_mask"):
            with context_parallel(comm, buffers=[buf], buffer_seq_dims=[2]):
                F.scaled_dot_product_attention(buf, buf, buf, attn_mask=torch.ones(1))
        assert torch.equal(buf, x)
        return True

    assert all(run_ranks(2, rank))
    assert getattr(F, "scaled_dot_product_attention", None) is sdpa_before


def test_no_restore_buffers_keep_their_shard():
    x = torch.arange(8, dtype=torch.float32).reshape(1, 8)

    def rank(comm):
        a, b = x.clone(), x.clone()
        with context_parallel(comm, buffers=[a, b], buffer_seq_dims=[1, 1], no_restore_buffers=[b]):
            pass
        return a, b

    for r, (a, b) in enumerate(run_ranks(2, rank)):
        assert torch.equal(a, x)
        assert b.tolist() == [[float(p) for p in cl.positions(8, 2, r, "zigzag")]]


def test_layout_shard_and_unshard_round_trip():
    x = np.arange(2 * 24 * 3).reshape(2, 24, 3)
    for layout in cl.LAYOUTS:
        bal = dict(mask="causal") if layout == "balanced" else {}  # it balances a mask
        shards = cl.shard_all(x, 4, layout=layout, seq_dim=1, **bal)
        assert np.array_equal(cl.unshard_all(shards, layout=layout, seq_dim=1, **bal), x)

    def rank(comm):
        s = cl.shard(torch.from_numpy(x).float(), comm, layout="striped", seq_dim=-2)
        return cl.unshard(s, comm, layout="striped", seq_dim=-2)

    for full in run_ranks(4, rank):
        assert np.array_equal(full.numpy(), x)


@pytest.mark.skipif(not hasattr(F, "scaled_dot_product_attention"), reason="torch < 2.0")
def test_blocks_on_threads_that_overlap_route_each_thread_through_its_own_block():
    # Rank 0 enters, rank 1 enters, rank 0 leaves, rank 1 leaves: rank 1 must still be routed
    # after rank 0 has left (a routed SDPA refuses attn_mask; torch's own takes it), a thread
    # without a block is not routed, and torch's function is never replaced.
    import threading
    sdpa_before = F.scaled_dot_product_attention
    step = [threading.Event() for _ in range(3)]
    x = torch.zeros(1, 2, 8, 16)

    def routed(buf):
        try:
            T = buf.shape[2]
            F.scaled_dot_product_attention(buf, buf, buf,
                                           attn_mask=torch.ones(T, T, dtype=torch.bool))
        except ValueError as e:
            return "attn_mask" in str(e)
        return False

    def rank(comm):
        buf = x.clone()
        if comm.rank == 0:
            with context_parallel(comm, buffers=[buf], buffer_seq_dims=[2]):
                step[0].set()
                step[1].wait(30)
            step[2].set()
            return routed(buf)
        step[0].wait(30)
        with context_parallel(comm, buffers=[buf], buffer_seq_dims=[2]):
            step[1].set()
            step[2].wait(30)
            return routed(buf)

    assert run_ranks(2, rank) == [False, True]
    assert F.scaled_dot_product_attention is sdpa_before


@pytest.mark.parametrize("ranks, layout", [(2, "zigzag"), (4, "striped"), (3, "contiguous")])
def test_context_parallel_unshard_is_the_layouts_inverse(ranks, layout):
    """torch's context_parallel_unshard: the block's shards (seq dims 1 and 2) gathered back
    equal the whole tensors, bit for bit, in global order; bfloat16 too."""
    from ctxpar.torch import context_parallel_unshard
    torch.manual_seed(0)
    a = torch.randn(2, 12 * ranks, 3)
    b = torch.randn(1, 2, 12 * ranks, 4).to(torch.bfloat16)

    def rank(comm):
        x, y = a.clone(), b.clone()
        with context_parallel(comm, buffers=[x, y], buffer_seq_dims=[1, 2], layout=layout):
            shards = [x.clone(), y.clone()]
        return context_parallel_unshard(comm, shards, [1, -2], layout=layout)

    for x, y in run_ranks(ranks, rank):
        assert torch.equal(x, a) and torch.equal(y, b)


def test_context_parallel_unshard_bad_arguments():
    from ctxpar.torch import context_parallel_unshard

    def rank(comm):
        x = torch.zeros(1, 4)
        for args, err, needle in [(([x], [1, 1]), ValueError, "seq_dims: 2 entries for 1"),
                                  (([x], [2]), ValueError, "seq_dims\\[0\\]"),
                                  (([x.numpy()], [1]), TypeError, "buffers\\[0\\]"),
                                  ((["x"], [0]), TypeError, "buffers\\[0\\]")]:
            with pytest.raises(err, match=needle):
                context_parallel_unshard(comm, *args)
        with pytest.raises(ValueError, match="layout"):
            context_parallel_unshard(comm, [x], [1], layout="ring")
        return True

    assert all(run_ranks(2, rank))


def test_set_rotate_method_picks_the_blocks_strategy():
    """torch's names: "allgather" -> ctxpar's allgather, "alltoall" -> ring, for blocks that
    name no strategy (a block's strategy= wins); the block's attention equals the fp64
    reference either way. A name torch does not have is refused and changes nothing."""
    import ctxpar.torch as ct
    q, k, v, dout = problem(B=1, T=T, Hq=2, Hkv=2)
    ok = visible(T, "causal")
    ref, naive = reference(q, k, v, dout, ok), reference(q, k, v, dout, ok, dtype=torch.float32)
    used = []
    real = ct.cp_attention

    def spy(*args, **kwargs):
        used.append(kwargs["strategy"])
        return real(*args, **kwargs)

    def run(strategy=None):
        def rank(comm):
            qs, ks, vs = (torch.from_numpy(x).transpose(1, 2).clone() for x in (q, k, v))
            with context_parallel(comm, buffers=[qs, ks, vs], buffer_seq_dims=[2, 2, 2],
                                  strategy=strategy):
                out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
            return cl.unshard(out, comm, seq_dim=2).transpose(1, 2)
        return run_ranks(2, rank)[0]

    try:
        ct.cp_attention = spy
        ct.set_rotate_method("allgather")
        check_close("allgather out", run(), ref[0], naive[0])
        with pytest.raises(ValueError, match="rotate_method: expected one of alltoall, allgather"):
            ct.set_rotate_method("ulysses")
        check_close("allgather still", run(), ref[0], naive[0])
        check_close("a block's own strategy", run("ulysses"), ref[0], naive[0])
        ct.set_rotate_method("alltoall")
        check_close("alltoall out", run(), ref[0], naive[0])
    finally:
        ct.cp_attention = real
        ct.set_rotate_method("alltoall")
    assert used == ["allgather"] * 4 + ["ulysses"] * 2 + ["ring"] * 2

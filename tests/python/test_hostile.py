"""Hostile input to the Python API (docs/faults.md, "Round two: the Python API"): every number
is range-checked with an error naming the argument; reserved or wrapping positions, a bad lse,
self-overlapping outputs, mismatched buffer dims and scale=0 are refused; ranks agree on
cp_attention's arguments; and a context_parallel block gives its leaves whole gradients back.
Ranks are threads here (ctxpar.run_threads); test_mpi.py runs the same agreement under mpirun."""
import math
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import ctxpar
from ctxpar import layout as cl
from ctxpar import _arrays, _ctxpar
from ctxpar.torch import context_parallel, cp_attention
from conftest import check_close, problem, reference, visible

T = 32


def run_ranks(ranks, fn, timeout_s=60):
    results = [None] * ranks

    def body(comm):
        results[comm.rank] = fn(comm)

    ctxpar.run_threads(ranks, body, timeout_s=timeout_s)
    return results


def qkv(kind="numpy"):
    q, k, v, _ = problem(T=T)
    return (q, k, v) if kind == "numpy" else tuple(torch.from_numpy(x) for x in (q, k, v))


def on_one_rank(call):
    """call(comm) on a world of one rank (cp_attention, context_parallel need a communicator)."""
    return lambda: run_ranks(1, call)


def timeout_setter(value):
    def set_it(comm):
        comm.timeout_s = value
    return set_it


# (the call, the error, words the message must hold: the argument, the value, the range)
NUMBERS = [
    (lambda: ctxpar.attention(*qkv(), threads=10**6), ValueError,
     ["threads", "[1, 1024]", "1000000"]),
    (lambda: ctxpar.attention(*qkv(), threads=0), ValueError, ["threads", "[1, 1024]", "got 0"]),
    (lambda: ctxpar.attention(*qkv(), threads=True), TypeError, ["threads", "True"]),
    (lambda: ctxpar.attention(*qkv(), ranks=2**40), ValueError,
     ["ranks", "[1, 1024]", str(2**40)]),
    (lambda: ctxpar.attention(*qkv(), ranks="2"), TypeError, ["ranks", "'2'"]),
    (lambda: ctxpar.attention(*qkv(), layout=None), TypeError,
     ["layout", "contiguous, zigzag, striped", "None"]),
    (lambda: ctxpar.attention(*qkv(), strategy=3), TypeError,
     ["strategy", "ring, allgather, ulysses, hybrid", "3"]),
    (lambda: ctxpar.attention(*qkv(), ulysses_degree=-1), ValueError,
     ["ulysses_degree", "[0, 1048576]", "-1"]),
    (lambda: ctxpar.attention(*qkv(), head_groups=2**31), ValueError,
     ["head_groups", "[0, 65536]", str(2**31)]),
    (lambda: ctxpar.attention(*qkv(), mask=("window", 2.5, 0)), TypeError, ["mask", "2.5"]),
    (lambda: ctxpar.attention_backward(*qkv(), *qkv()[:1], np.zeros((2, 4, T), np.float32),
                                       qkv()[0], ranks=-3), ValueError, ["ranks", "-3"]),
    (lambda: ctxpar.run_threads(2, lambda c: None, timeout_s=math.inf), ValueError,
     ["timeout_s", "[0.001, 1e+06]", "inf"]),
    (lambda: ctxpar.run_threads(2, lambda c: None, timeout_s=0), ValueError,
     ["timeout_s", "0.0"]),
    (lambda: ctxpar.run_threads(2**40, lambda c: None), ValueError, ["ranks", "[1, 1024]"]),
    (lambda: ctxpar.init(timeout_s=-1), ValueError, ["timeout_s", "-1"]),
    (on_one_rank(timeout_setter(math.nan)), ValueError, ["timeout_s", "nan"]),
    (on_one_rank(lambda c: cp_attention(*qkv("torch"), c, threads=2**31)), ValueError,
     ["threads", "[1, 1024]"]),
    (on_one_rank(lambda c: context_parallel(c, threads=-1).__enter__()), ValueError,
     ["threads", "-1"]),
    (on_one_rank(lambda c: context_parallel(c, layout=None).__enter__()), TypeError,
     ["layout", "None"]),
    (lambda: cl.positions(10**30, 2, 0), ValueError, ["tokens", str(10**30), "[1, 1099511627776]"]),
    (lambda: cl.positions(32, 2, 2), ValueError, ["rank", "[0, 1]", "got 2"]),
    (lambda: cl.shard(np.zeros((2, 8)), rank=0, ranks=2, seq_dim=1.5), TypeError,
     ["seq_dim", "1.5"]),
]


@pytest.mark.parametrize("call, error, words", NUMBERS)
def test_numbers_and_names_are_range_checked_naming_the_argument(call, error, words):
    with pytest.raises(error) as info:
        call()
    for w in words:
        assert w in str(info.value), str(info.value)
    assert "Invoked with" not in str(info.value)


def test_argument_ranges_are_the_librarys():
    """ctxpar._checks reads its ranges from the library (include/ctxpar/limits.h, comm.h), the
    ones the command's options use: no copy of them to drift."""
    from ctxpar import _checks
    limits = _ctxpar._limits
    assert (_checks.MAX_THREADS, _checks.MAX_THREADS_RANKS, _checks.MAX_PROCESSES,
            _checks.MAX_TOKENS, _checks.MAX_HEADS, _checks.MIN_TIMEOUT, _checks.MAX_TIMEOUT) == \
        (limits["threads"], limits["threads_ranks"], limits["processes"], limits["tokens"],
         limits["heads"], limits["min_timeout"], limits["max_timeout"])
    assert (limits["threads"], limits["threads_ranks"], limits["processes"], limits["tokens"],
            limits["heads"], limits["min_timeout"], limits["max_timeout"]) == \
        (1024, 1024, 1 << 20, 1 << 40, 1 << 16, 1e-3, 1e6)
    with pytest.raises(ValueError, match=r"threads: must be in \[1, 1024\], got 1025"):
        _checks.threads(1025)


def test_the_communicator_timeout_is_settable_and_used():
    rank0_done = threading.Event()

    def rank(comm):
        assert comm.timeout_s == 120.0  # the default
        comm.timeout_s = 0.5
        if comm.rank == 1:  # alive but silent until rank 0 gave up
            rank0_done.wait(60)
            return
        try:
            comm.barrier()  # fails after 0.5 s, not 120
        finally:
            rank0_done.set()

    with pytest.raises(ctxpar.Error, match="timed out after 0.5 s"):
        run_ranks(2, rank, timeout_s=120)
    assert run_ranks(1, lambda comm: comm.timeout_s, timeout_s=7.5) == [7.5]


def test_padding_position_and_wrapping_positions_are_refused():
    positions = np.arange(T, dtype=np.int64)
    positions[5] = np.iinfo(np.int64).min
    with pytest.raises(ValueError, match=r"positions: token 5 has position -9223372036854775808 "
                                         r"\(INT64_MIN\), which marks padding"):
        ctxpar.attention(*qkv(), positions=positions)
    wrapping = np.arange(T, dtype=np.uint64)
    wrapping[7] = np.uint64(2**63)
    with pytest.raises(ValueError, match=r"positions: token 7 has 9223372036854775808, outside "
                                         r"int64's range"):
        ctxpar.attention(*qkv(), positions=wrapping)
    with pytest.raises(ValueError, match="document_ids: token 0 has 4294967296"):
        ctxpar.attention(*qkv(), document_ids=np.full(T, 2**32, np.uint64))
    # the largest uint64 that fits int64 is still fine
    ok = np.arange(T, dtype=np.uint64) + np.uint64(2**63 - 1 - T)
    out, _ = ctxpar.attention(*qkv(), positions=ok, mask="causal")
    assert np.isfinite(out).all()


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_backward_refuses_nan_or_plus_inf_lse_naming_the_first_one(kind, bad):
    q, k, v, dout = problem(T=T)
    out, lse = ctxpar.attention(q, k, v)
    lse[1, 2, 9] = bad
    lse[1, 3, 0] = bad
    args = (q, k, v, out, lse, dout)
    if kind == "torch":
        args = tuple(torch.from_numpy(x) for x in args)
    with pytest.raises(ValueError, match=f"lse: batch 1, head 2, token 9 holds {bad}"):
        ctxpar.attention_backward(*args)


def test_minus_inf_lse_of_a_row_that_sees_no_key_passes_the_check():
    # Every token sees itself under the Python API's masks, so such a row is built by hand.
    lse = ctxpar.attention(*qkv())[1]
    lse[0, 1, 3] = -math.inf
    _arrays.check_lse(lse)
    _arrays.check_lse(torch.from_numpy(lse))


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_an_out_that_overlaps_itself_is_refused(kind):
    q, k, v = qkv(kind)
    if kind == "torch":
        out = torch.empty(2, 1, 4, 16).expand(2, T, 4, 16)  # stride 0 over tokens
    else:
        out = np.lib.stride_tricks.as_strided(np.empty((2, 1, 4, 16), np.float32),
                                              (2, T, 4, 16), (256, 0, 64, 4), writeable=True)
    with pytest.raises(ValueError, match=r"out: its elements overlap in memory \(shape "
                                         r"\(2, 32, 4, 16\), strides \(64, 0, 16, 1\)"):
        ctxpar.attention(q, k, v, out=out)
    # a strided out that does not overlap is still written in place
    base = np.zeros((2, T, 4, 32), np.float32) if kind == "numpy" else torch.zeros(2, T, 4, 32)
    view = base[..., 8:24]
    got, _ = ctxpar.attention(q, k, v, out=view)
    assert got is view
    ref, _ = ctxpar.attention(q, k, v)
    assert np.array_equal(np.asarray(base[..., 8:24]), np.asarray(ref))


@pytest.mark.parametrize("bad, error", [
    (0.0, "scale: 0 is not a usable softmax scale"),
    (1e-60, "scale: 1e-60, 0 in float32, is not a usable"),
    (math.nan, "scale: must be finite"),
    (math.inf, "scale: must be finite"),
    (1e39, "scale: must be finite"),
    (-0.5, "scale: must be positive, got -0.5"),
    ("0.5", "scale: expected None"),
])
def test_scale_zero_or_non_finite_is_refused_and_none_means_one_over_sqrt_d(bad, error):
    with pytest.raises((ValueError, TypeError), match=error):
        ctxpar.attention(*qkv(), scale=bad)
    q, k, v = qkv()
    default, _ = ctxpar.attention(q, k, v)
    explicit, _ = ctxpar.attention(q, k, v, scale=16 ** -0.5)
    assert np.array_equal(default, explicit)


@pytest.mark.parametrize("name, values", [
    ("layout", ("zigzag", "striped")),
    ("mask", ("causal", "none")),
    ("scale", (None, 0.5)),
    ("positions", (None, np.arange(T)[::-1].copy())),
    ("document_ids", (None, np.repeat(np.arange(4, dtype=np.int32), T // 4))),
    ("strategy", ("ring", "allgather")),
])
def test_cp_attention_ranks_agree_on_their_arguments(name, values):
    q, k, v = qkv("torch")

    def rank(comm):
        kwargs = dict(layout="zigzag")
        kwargs[name] = values[comm.rank]
        local = [cl.shard(x, comm, layout=kwargs["layout"], seq_dim=1) for x in (q, k, v)]
        with pytest.raises(ValueError) as info:
            cp_attention(*local, comm, **kwargs)
        return str(info.value)

    for message in run_ranks(2, rank):
        assert message.startswith(f"cp_attention: the ranks were called with different "
                                  f"arguments: {name} is ")
        assert "on rank 0 but" in message and "on rank 1" in message
    if name in ("layout", "mask", "strategy"):
        assert f"{values[0]} on rank 0 but {values[1]} on rank 1" in run_ranks(2, rank)[0]


def test_context_parallel_refuses_buffers_whose_seq_dims_disagree():
    def rank(comm):
        q = torch.zeros(1, 4, T, 16)   # [B, H, T, D]
        pos = torch.zeros(1, T)
        with pytest.raises(ValueError) as info:
            with context_parallel(comm, buffers=[q, pos], buffer_seq_dims=[2, 0]):
                pass
        assert q.shape == (1, 4, T, 16)
        with pytest.raises(ValueError, match=r"buffer_seq_dims\[1\]: must be in \[-2, 1\], got 2"):
            with context_parallel(comm, buffers=[q, pos], buffer_seq_dims=[2, 2]):
                pass
        with pytest.raises(ValueError, match="cannot be cut into 2 equal shards by the zigzag"):
            with context_parallel(comm, buffers=[torch.zeros(1, 4, 6, 16)], buffer_seq_dims=[2]):
                pass
        return str(info.value)

    for message in run_ranks(2, rank):
        assert message.startswith("buffer_seq_dims[1]: buffers[1] has 1 tokens along dim 0 "
                                  "(shape (1, 32)) but buffers[0] has 32 along dim 2")


def test_context_parallel_gives_leaves_their_whole_gradient_back():
    q, k, v, dout = problem(T=T)
    bhtd = [torch.from_numpy(x).transpose(1, 2).contiguous() for x in (q, k, v, dout)]
    earlier = torch.full_like(bhtd[1], 0.25)  # k's gradient from before the block

    def rank(comm):
        bufs = [x.clone().requires_grad_() for x in bhtd[:3]]
        bufs[1].grad = earlier.clone()
        grad_out = cl.shard(bhtd[3], comm, layout="zigzag", seq_dim=2)
        with context_parallel(comm, buffers=bufs, buffer_seq_dims=[2, 2, 2]):
            out = F.scaled_dot_product_attention(*bufs, is_causal=True, enable_gqa=True)
            (out * grad_out).sum().backward()
        for b in bufs:
            assert b.grad.shape == b.shape
        torch.optim.SGD(bufs, lr=0.1).step()  # the step that failed on shard-shaped grads
        return [b.grad.transpose(1, 2) for b in bufs]

    ok = visible(T, "causal")
    ref, naive = reference(q, k, v, dout, ok), reference(q, k, v, dout, ok, dtype=torch.float32)
    late = earlier.transpose(1, 2).double()
    for grads in run_ranks(2, rank):
        check_close("dq", grads[0], ref[2], naive[2])
        check_close("dk", grads[1] - late, ref[3], naive[3])
        check_close("dv", grads[2], ref[4], naive[4])


def test_a_rank_thread_ends_cleanly_with_a_tensor_view_in_a_thread_local():
    # A threading.local holding a torch view on a rank thread killed the process (SIGSEGV) when
    # the rank ended: its Python state was cleared after PyGILState_Release had dropped the
    # counter to 0 (Note [A rank thread's Python state]). In a child process: a crash ends it only.
    code = ("import threading, torch, ctxpar\n"
            "loc = threading.local()\n"
            "def rank(c):\n"
            "    loc.t = torch.arange(16)[None].expand(2, 16)[:, :8]\n"
            "for _ in range(3):\n"
            "    ctxpar.run_threads(2, rank)\n"
            "print('ended')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (r.returncode, r.stdout.strip()) == (0, "ended"), r.stderr[-2000:]

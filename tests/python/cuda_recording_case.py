"""The Python package's CUDA path on a machine without a GPU (run by test_cuda_tensors.py in a
process of its own, with CTXPAR_KERNEL=scalar): fake CUDA tensors (fake_cuda.py: CPU memory
exported through DLPack as kDLCUDA) on the test-only recording cuda device
(the test build's _testing_cuda_recording: RecordingCudaApi, host memory, the fallback kernel's tile
math), against the cpu device on the same inputs. The recording device over the threads
transport is bitwise the cpu device's scalar kernel (docs/cuda.md), so every result must have
the same bits; and every device's log must show no ordering violation, no leak, and the
caller's memory adopted (used in place) and handed back after a synchronisation."""
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ctxpar  # noqa: E402
from ctxpar.torch import cp_attention  # noqa: E402
from conftest import problem  # noqa: E402
from fake_cuda import exports, on_fake_gpu, test_hooks  # noqa: E402

_ctxpar = test_hooks()

assert os.environ.get("CTXPAR_KERNEL") == "scalar", "run with CTXPAR_KERNEL=scalar"


def same_bits(name, got, want):
    assert isinstance(got, torch.Tensor) and got.dtype == want.dtype, f"{name}: {got!r}"
    bits = torch.int16 if got.dtype == torch.bfloat16 else torch.int32
    assert torch.equal(got.view(bits), want.view(bits)), \
        f"{name}: bits differ (max |diff| {(got.float() - want.float()).abs().max()})"


def check_reports(what, devices):
    """Every recording device that ran: no violation, no leak; `devices` of them adopted the
    caller's tensors and handed every range back."""
    reports = [r for r in _ctxpar._testing_cuda_reports() if r["ops"]]
    for r in reports:
        assert r["violations"] == [], f"{what}: {r['violations']}"
        assert r["live"] == 0 and r["host_live"] == 0, f"{what}: leak {r}"
        assert r["releases"] == r["adopts"], f"{what}: {r}"
    adopting = [r for r in reports if r["adopts"]]
    assert len(adopting) == devices, f"{what}: {len(adopting)} devices adopted memory: {reports}"


def per_rank(strategy, layout, mask, dtype, P=2):
    q, k, v, dout = (torch.from_numpy(x).to(dtype) for x in problem(T=32, D=16))
    Tl = q.shape[1] // P

    def run(make):
        results = [None] * P

        def rank(comm):
            idx = torch.as_tensor(ctxpar.layout.positions(q.shape[1], P, comm.rank, layout))
            qs, ks, vs, gs = (make(x[:, idx]) for x in (q, k, v, dout))
            for x in (qs, ks, vs):
                x.requires_grad_(True)
            out, lse = cp_attention(qs, ks, vs, comm, layout=layout, mask=mask,
                                    strategy=strategy, return_lse=True)
            out.backward(gs)
            results[comm.rank] = (out.detach(), lse, qs.grad, ks.grad, vs.grad)

        ctxpar.run_threads(P, rank)
        return results

    cpu = run(lambda x: x.clone())
    _ctxpar._testing_cuda_reports()
    del exports[:]
    with on_fake_gpu():
        cuda = run(lambda x: x.clone())
    assert exports, "no tensor crossed as a CUDA tensor"
    what = f"cp_attention {strategy} {layout} {mask} {dtype} P={P}"
    for r in range(P):
        for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), cuda[r], cpu[r]):
            assert g.shape[1] == Tl or name == "lse"
            same_bits(f"{what} rank {r} {name}", g, w)
    check_reports(what, 2 * P)  # forward and backward, each rank


def whole(strategy, layout, mask, dtype, ranks):
    q, k, v, dout = (torch.from_numpy(x).to(dtype) for x in problem(T=32, D=16, seed=3))
    kw = dict(ranks=ranks, strategy=strategy, layout=layout, mask=mask)
    out, lse = ctxpar.attention(q, k, v, **kw)
    grads = ctxpar.attention_backward(q, k, v, out, lse, dout, **kw)
    _ctxpar._testing_cuda_reports()
    del exports[:]
    with on_fake_gpu():
        fout, flse = ctxpar.attention(q, k, v, **kw)
        fgrads = ctxpar.attention_backward(q, k, v, fout, flse, dout, **kw)
    assert exports, "no tensor crossed as a CUDA tensor"
    what = f"attention {strategy} {layout} {mask} {dtype} ranks={ranks}"
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), (fout, flse) + fgrads,
                          (out, lse) + grads):
        same_bits(f"{what} {name}", g, w)
    check_reports(what, 2 * ranks)


def in_context_parallel(P=2):
    """torch's scaled_dot_product_attention inside context_parallel: the buffers' gradients
    (gathered whole at the block's end) have the CPU device's bits."""
    from ctxpar.torch import context_parallel
    import torch.nn.functional as F
    q, k, v, dout = (torch.from_numpy(x).transpose(1, 2).contiguous()
                     for x in problem(T=32, Hq=2, Hkv=2, D=16, seed=5))

    def run():
        grads = [None] * P

        def rank(comm):
            qs, ks, vs = (x.clone().requires_grad_(True) for x in (q, k, v))
            with context_parallel(comm, buffers=[qs, ks, vs], buffer_seq_dims=[2, 2, 2]):
                out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
                out.backward(ctxpar.layout.shard(dout, comm, seq_dim=2))
            grads[comm.rank] = (qs.grad, ks.grad, vs.grad)

        ctxpar.run_threads(P, rank)
        return grads

    cpu = run()
    _ctxpar._testing_cuda_reports()
    with on_fake_gpu():
        cuda = run()
    for r in range(P):
        for name, g, w in zip(("dq", "dk", "dv"), cuda[r], cpu[r]):
            same_bits(f"context_parallel rank {r} {name}", g, w)
    check_reports("context_parallel", 2 * P)


_ctxpar._testing_cuda_recording(True)
try:
    assert _ctxpar._cuda_unavailable() == ""
    per_rank("ring", "zigzag", "causal", torch.float32)
    per_rank("ulysses", "striped", "none", torch.bfloat16)
    per_rank("allgather", "contiguous", ("window", 5, 2), torch.float32)
    whole("ring", "zigzag", "causal", torch.float32, 1)
    whole("ring", "zigzag", "causal", torch.float32, 2)
    whole("hybrid", "striped", "none", torch.bfloat16, 4)
    in_context_parallel()
finally:
    _ctxpar._testing_cuda_recording(False)
print("OK")

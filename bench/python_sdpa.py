"""Side by side, one problem, one run: PyTorch's scaled dot-product attention on the CPU vs
ctxpar.attention (P ranks as threads), forward and forward + backward, speed and error against
an fp64 autograd reference. Prints one JSON object; the figures that matter are ratios taken
in the same run (machines here are shared). Run it on a quiet machine:

    .venv/bin/python bench/python_sdpa.py --seq 2048 --heads 4 --head-dim 64 --ranks 2 --threads 2

torch 1.13 (Debian) has no public F.scaled_dot_product_attention (torch >= 2.0) and only the
private F._scaled_dot_product_attention, which is used then; it has no
torch.distributed.tensor.experimental.context_parallel either (torch >= 2.5): the JSON says
which ran and why the other did not.
"""
import argparse
import json
import time

import numpy as np
import torch
import torch.nn.functional as F

import ctxpar


def torch_sdpa():
    """(name, fn(q, k, v) -> out) on [B, H, T, D], causal."""
    if hasattr(F, "scaled_dot_product_attention"):
        return "F.scaled_dot_product_attention", lambda q, k, v: F.scaled_dot_product_attention(
            q, k, v, is_causal=True)
    return ("F._scaled_dot_product_attention (torch < 2.0: the private predecessor)",
            lambda q, k, v: F._scaled_dot_product_attention(q, k, v, None, 0.0, False, True)[0])


def torch_context_parallel():
    try:
        from torch.distributed.tensor.experimental import context_parallel  # noqa: F401
    except ImportError as e:
        return (f"not run: torch {torch.__version__} has no "
                f"torch.distributed.tensor.experimental.context_parallel (added in torch 2.5): {e}")
    return ("available but not run here: it needs a DeviceMesh over a process group; "
            "ctxpar's figure is the in-process one above")


def best_of(repeats, fn):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def reference(q, k, v, dout):
    """fp64 autograd of plain causal softmax attention on [B, T, H, D]."""
    q64, k64, v64 = (torch.from_numpy(x).double().requires_grad_() for x in (q, k, v))
    T = q.shape[1]
    s = torch.einsum("bihd,bjhd->bhij", q64, k64) * q.shape[3] ** -0.5
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("bhij,bjhd->bihd", torch.softmax(s, -1), v64)
    out.backward(torch.from_numpy(dout).double())
    return out.detach(), q64.grad


def max_err(x, ref):
    return float((torch.as_tensor(np.asarray(x)).double() - ref).abs().max())


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--threads", type=int, default=1,
                   help="ctxpar threads per rank; torch gets ranks x threads (the same cores)")
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    torch.set_num_threads(a.ranks * a.threads)
    rng = np.random.default_rng(0)
    shape = (a.batch, a.seq, a.heads, a.head_dim)
    q, k, v, dout = (rng.standard_normal(shape).astype(np.float32) for _ in range(4))
    ref_out, ref_dq = reference(q, k, v, dout)

    name, sdpa = torch_sdpa()
    tq, tk, tv = (torch.from_numpy(x).transpose(1, 2).requires_grad_() for x in (q, k, v))
    tg = torch.from_numpy(dout).transpose(1, 2)

    def torch_fwd():
        with torch.no_grad():
            return sdpa(tq, tk, tv)

    def torch_fwd_bwd():
        tq.grad = None
        sdpa(tq, tk, tv).backward(tg)

    t_out = torch_fwd().transpose(1, 2)
    torch_fwd_bwd()
    torch_row = dict(impl=name, version=torch.__version__, threads=a.ranks * a.threads,
                     fwd_s=best_of(a.repeats, torch_fwd),
                     fwd_bwd_s=best_of(a.repeats, torch_fwd_bwd),
                     err_out=max_err(t_out.detach(), ref_out),
                     err_dq=max_err(tq.grad.transpose(1, 2), ref_dq))

    opts = dict(ranks=a.ranks, strategy="ring", layout="zigzag", mask="causal", threads=a.threads)
    state = {}

    def ctx_fwd():
        state["out"], state["lse"] = ctxpar.attention(q, k, v, **opts)

    def ctx_fwd_bwd():
        ctx_fwd()
        state["grads"] = ctxpar.attention_backward(q, k, v, state["out"], state["lse"], dout,
                                                   **opts)

    ctx_fwd_bwd()
    ctx_row = dict(impl="ctxpar.attention (ring, zigzag)", version=ctxpar.__version__,
                   ranks=a.ranks, threads_per_rank=a.threads,
                   fwd_s=best_of(a.repeats, ctx_fwd), fwd_bwd_s=best_of(a.repeats, ctx_fwd_bwd),
                   err_out=max_err(state["out"], ref_out), err_dq=max_err(state["grads"][0], ref_dq))
    print(json.dumps(dict(
        problem=dict(batch=a.batch, seq=a.seq, heads=a.heads, head_dim=a.head_dim, mask="causal",
                     dtype="float32"),
        torch=torch_row, ctxpar=ctx_row,
        ctxpar_speedup_fwd=torch_row["fwd_s"] / ctx_row["fwd_s"],
        ctxpar_speedup_fwd_bwd=torch_row["fwd_bwd_s"] / ctx_row["fwd_bwd_s"],
        torch_context_parallel=torch_context_parallel()), indent=2))


if __name__ == "__main__":
    main()

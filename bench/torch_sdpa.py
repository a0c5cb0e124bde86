"""PyTorch's CPU scaled dot-product attention timed the way `ctxpar bench kernel` times ctxpar's
kernel: fp32 (or bf16 with --dtype bf16), random normal q, k, v and a fixed dout, forward and
backward, non-causal and causal, on a set number of threads. Prints one JSON object. bench/cpu_suite.sh runs it once per
repetition, alternating with ctxpar, and takes the ratios; run by hand:

    .venv-torch/bin/python bench/torch_sdpa.py --seq 4096 --heads 8 --head-dim 128 --threads 1

Protocol, per mask and per repeat: the forward of a training step (q, k, v require grad; the
output is what the backward needs) is timed as the forward figure; then only the
`out.backward(dout)` call is timed as the backward figure (.grad cleared before, so it
includes writing fresh dq, dk, dv, as ctxpar's backward writes zeroed ones). The best over
--repeats counts, as in `bench kernel`. Before timing, one warm-up forward + backward per mask
at --warmup-seq tokens (same B, H, D) starts torch's thread pool and dispatch, and the
profiler records which aten kernels ran (`backend`: on the CPU, the flash kernel
aten::_scaled_dot_product_flash_attention_for_cpu, else the materialising math path).

Layout: by default torch's [B, H, T, D], contiguous (a head's rows side by side, SDPA's own
layout); ctxpar's kernel takes [B, T, H, D]. Same numbers of elements and the same FLOPs; each
side gets its own layout. --memory bthd gives torch [B, H, T, D] views of [B, T, H, D] storage
instead (`x.transpose(1, 2)`): what a model's projections hand SDPA (`q_proj(x).view(B, T, H,
D).transpose(1, 2)`), and the memory ctxpar's kernel reads in `ctxpar bench kernel`.
Needs torch >= 2.0 (the public F.scaled_dot_product_attention) and nothing else.
"""
import argparse
import json
import os
import sys
import time


def flops(b, h, t, d, causal):
    """The FLOP count `ctxpar bench kernel` uses: forward 4*B*H*T*T*D, halved for causal."""
    f = 4.0 * b * h * t * t * d
    return f / 2 if causal else f


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=4096, help="sequence length T")
    p.add_argument("--heads", type=int, default=8, help="heads H")
    p.add_argument("--head-dim", type=int, default=128, help="head dimension D")
    p.add_argument("--batch", type=int, default=1, help="batch size B")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument("--repeats", type=int, default=1, help="timed repetitions; the best counts")
    p.add_argument("--masks", default="none,causal", help="comma list of none, causal")
    p.add_argument("--warmup-seq", type=int, default=1024,
                   help="tokens of the warm-up forward + backward (at most --seq)")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"),
                   help="q, k, v, dout and the gradients in fp32 or bfloat16 (torch's own bf16 path)")
    p.add_argument("--memory", default="bhtd", choices=("bhtd", "bthd"),
                   help="the storage behind q, k, v and dout: bhtd ([B, H, T, D] contiguous) or "
                   "bthd ([B, T, H, D] contiguous, passed as its [B, H, T, D] transpose: a model's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--info", action="store_true",
                   help="print torch's version and CPU capability only, time nothing")
    a = p.parse_args(argv)
    for name in ("seq", "heads", "head_dim", "batch", "threads", "repeats", "warmup_seq"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(a, name)})")
    a.masks = [m for m in a.masks.split(",") if m]
    bad = [m for m in a.masks if m not in ("none", "causal")]
    if bad or not a.masks:
        p.error(f"--masks takes a comma list of none, causal (got {','.join(bad) or 'nothing'})")
    return a


def versions(torch):
    return dict(torch_version=torch.__version__,
                cpu_capability=torch.backends.cpu.get_cpu_capability(),
                python=sys.version.split()[0])


def aten_kernels(torch, fn):
    """The attention aten ops `fn` ran, from the profiler (which backend SDPA chose)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sorted({e.key for e in prof.key_averages()
                   if "attention" in e.key and e.key != "aten::scaled_dot_product_attention"})


def main(argv=None):
    a = parse_args(argv)
    try:
        import torch
        import torch.nn.functional as F
    except ImportError as e:
        sys.exit(f"torch_sdpa.py: cannot import torch with {sys.executable}: {e}; "
                 "run it with the interpreter of a venv that has torch (bench/cpu_suite.sh makes "
                 ".venv-torch)")
    if a.info:
        print(json.dumps(versions(torch)))
        return
    if not hasattr(F, "scaled_dot_product_attention"):
        sys.exit(f"torch_sdpa.py: torch {torch.__version__} has no "
                 "F.scaled_dot_product_attention (torch >= 2.0 has); install a current torch")
    torch.set_num_threads(a.threads)
    gen = torch.Generator().manual_seed(a.seed)

    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32

    def tensor(t):
        """[B, H, T, D], on the --memory storage (random normal, then the dtype)."""
        if a.memory == "bhtd":
            return torch.randn((a.batch, a.heads, t, a.head_dim), generator=gen).to(dtype)
        return torch.randn((a.batch, t, a.heads, a.head_dim), generator=gen).to(dtype).transpose(1, 2)

    def inputs(t):
        q, k, v = (tensor(t).requires_grad_() for _ in range(3))
        return q, k, v, tensor(t)

    def step(q, k, v, dout, causal):
        """(forward s, backward s) of one training step; only the two calls are timed."""
        for x in (q, k, v):
            x.grad = None
        t0 = time.perf_counter()
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        t1 = time.perf_counter()
        out.backward(dout)
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1

    warm = inputs(min(a.warmup_seq, a.seq))
    backend = {}
    for m in a.masks:
        backend[m] = aten_kernels(torch, lambda: step(*warm, m == "causal"))
    del warm
    q, k, v, dout = inputs(a.seq)
    result = dict(versions(torch), threads=torch.get_num_threads(), batch=a.batch, seq=a.seq,
                  heads=a.heads, head_dim=a.head_dim, dtype=a.dtype, repeats=a.repeats,
                  layout=("[B, H, T, D] contiguous" if a.memory == "bhtd" else
                          "[B, H, T, D] views of [B, T, H, D] storage"), memory=a.memory,
                  q_stride=list(q.stride()), seed=a.seed, warmup_seq=min(a.warmup_seq, a.seq),
                  omp_num_threads=os.environ.get("OMP_NUM_THREADS"))
    for m in a.masks:
        causal = m == "causal"
        times = [step(q, k, v, dout, causal) for _ in range(a.repeats)]
        fwd, bwd = min(t[0] for t in times), min(t[1] for t in times)
        f = flops(a.batch, a.heads, a.seq, a.head_dim, causal)
        key = "causal_" if causal else ""
        result[key + "fwd_seconds"] = fwd
        result[key + "bwd_seconds"] = bwd
        result[key + "fwd_gflops"] = f / fwd / 1e9
        result[key + "bwd_gflops"] = 2.5 * f / bwd / 1e9
        result[key + "times"] = [list(t) for t in times]
        result[key + "backend"] = backend[m]
    print(json.dumps(result))


if __name__ == "__main__":
    main()

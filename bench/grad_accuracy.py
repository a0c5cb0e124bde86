"""fp32 accuracy at long T: ctxpar's fp32 kernel (one or more builds, through the CLI) and
PyTorch's fp32 CPU scaled_dot_product_attention, both against an fp64 reference of the same
inputs, forward O and backward dQ, dK, dV. A key row's dK / dV sums every query row
that sees it, so its error is the one that grows with T. Run with an interpreter that has torch
and NumPy:

    /work/main/.venv-torch/bin/python bench/grad_accuracy.py --ctxpar new=build/ctxpar \\
        --ctxpar old=/tmp/ctxpar_old --seq 16384 --heads 8

Inputs: normal q, k, v, dout in fp32, [B=1, T, H, D], causal by default. The reference runs
in blocks of query rows (scores of one block in fp64 at a time: memory ~ 40 * rows * T bytes).
Reported per output and side: the largest absolute error, it over the largest |reference|, and
the root-mean-square error.
Prints one JSON object; exit 1 if any error is over 5 % of the largest |reference|."""
import argparse
import json
import os
import subprocess
import sys
import tempfile


def reference(f64, causal, scale, block):
    """fp64 O, dQ, dK, dV of [T, H, D] arrays, query rows `block` at a time."""
    import numpy as np
    t, heads, _ = f64["q"].shape
    ref = {n: np.zeros(f64["q"].shape) for n in ("out", "dq", "dk", "dv")}
    cols = np.arange(t)
    for h in range(heads):
        q, k, v, do = (f64[n][:, h, :] for n in ("q", "k", "v", "do"))
        for i0 in range(0, t, block):
            i1 = min(t, i0 + block)
            # Causal: rows i0..i1-1 see keys up to i1-1 only; the rest contributes nothing.
            kend = i1 if causal else t
            s = q[i0:i1] @ k[:kend].T * scale
            if causal:
                s[cols[None, :kend] > np.arange(i0, i1)[:, None]] = -np.inf
            pm = np.exp(s - s.max(axis=1, keepdims=True))
            pm /= pm.sum(axis=1, keepdims=True)
            o = pm @ v[:kend]
            ds = pm * (do[i0:i1] @ v[:kend].T - (do[i0:i1] * o).sum(axis=1, keepdims=True))
            ref["out"][i0:i1, h] = o
            ref["dq"][i0:i1, h] = ds @ k[:kend] * scale
            ref["dk"][:kend, h] += ds.T @ q[i0:i1] * scale
            ref["dv"][:kend, h] += pm.T @ do[i0:i1]
    return {n: r[None] for n, r in ref.items()}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ctxpar", action="append", required=True,
                   help="NAME=PATH of a ctxpar command (repeat to compare builds)")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--mask", default="causal", choices=("none", "causal"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="ctxpar and torch threads")
    p.add_argument("--block", type=int, default=1024, help="reference query rows per block")
    a = p.parse_args()
    if min(a.seq, a.heads, a.head_dim, a.block) < 1:
        p.error("--seq, --heads, --head-dim and --block must be >= 1")
    builds = []
    for spec in a.ctxpar:
        name, sep, path = spec.partition("=")
        if not sep or not os.access(path, os.X_OK):
            p.error(f"--ctxpar {spec}: expected NAME=PATH of an executable ctxpar")
        builds.append((name, path))
    try:
        import numpy as np
        import torch
    except ImportError as e:
        sys.exit(f"grad_accuracy.py: needs torch and NumPy in {sys.executable}: {e}")
    torch.set_num_threads(a.threads)

    causal = a.mask == "causal"
    gen = torch.Generator().manual_seed(a.seed)
    shape = (1, a.seq, a.heads, a.head_dim)  # ctxpar's [B, T, H, D]
    x = {n: torch.randn(shape, generator=gen) for n in ("q", "k", "v", "do")}
    scale = a.head_dim ** -0.5
    ref = reference({n: t.double().numpy()[0] for n, t in x.items()}, causal, scale, a.block)

    def errors(got):
        out = {}
        for n, r in ref.items():
            g = np.asarray(got[n], dtype=np.float64).reshape(r.shape)
            err, top = float(np.abs(g - r).max()), float(np.abs(r).max())
            rms = float(np.sqrt(np.mean((g - r) ** 2)))
            out[n] = dict(max_abs=err, max_abs_over_max_ref=err / top, rms=rms)
        return out

    result = dict(seq=a.seq, heads=a.heads, head_dim=a.head_dim, mask=a.mask,
                  torch_version=torch.__version__)
    with tempfile.TemporaryDirectory() as tmp:
        for n, t in x.items():
            np.save(os.path.join(tmp, n + ".npy"), t.numpy())
        for name, path in builds:
            outdir = os.path.join(tmp, "out_" + name)
            cmd = [path, "attention", "--q", f"{tmp}/q.npy", "--k", f"{tmp}/k.npy",
                   "--v", f"{tmp}/v.npy", "--do", f"{tmp}/do.npy", "--dtype", "fp32",
                   "--mask", a.mask, "--threads", str(a.threads), "--out", outdir]
            run = subprocess.run(cmd, capture_output=True, text=True)
            if run.returncode != 0:
                sys.exit(f"grad_accuracy.py: {' '.join(cmd)} failed: {run.stderr.strip()}")
            result["ctxpar_" + name] = errors(
                {n: np.load(os.path.join(outdir, n + ".npy")) for n in ref})

    # torch: its fp32 CPU path, [B, H, T, D].
    tq, tk, tv = (x[n].transpose(1, 2).contiguous().requires_grad_() for n in ("q", "k", "v"))
    o = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
    o.backward(x["do"].transpose(1, 2).contiguous())
    result["torch_fp32"] = errors({"out": o.detach().transpose(1, 2).numpy(),
                                   "dq": tq.grad.transpose(1, 2).numpy(),
                                   "dk": tk.grad.transpose(1, 2).numpy(),
                                   "dv": tv.grad.transpose(1, 2).numpy()})
    print(json.dumps(result))
    worst = max(e["max_abs_over_max_ref"] for side, errs in result.items()
                if isinstance(errs, dict) for e in errs.values())
    return 1 if worst > 0.05 else 0


if __name__ == "__main__":
    sys.exit(main())

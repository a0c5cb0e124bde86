"""Accuracy beside speed for bf16 inputs: ctxpar (bf16 storage, fp32 arithmetic; the CLI) and
PyTorch's CPU scaled_dot_product_attention in bfloat16 on the same bf16 values, both against an
fp64 reference of those values, forward O and backward dQ, dK, dV. bench/cpu_suite.sh's bf16
rows say who is faster; this says what each answer is worth. Run with an interpreter that has
torch and NumPy (the suite's venv):

    .venv-torch/bin/python bench/bf16_accuracy.py --ctxpar build/ctxpar --seq 2048 --heads 4

Inputs: normal q, k, v, dout rounded to bf16 (so both sides read identical values), [B=1, T, H,
D], causal by default. Reported per output: the largest absolute error and the RMS error, each
over the largest |reference|. Prints one JSON object; exit 1 if either side's error is over 5 %
of the largest |reference| (a wrong result, not a rounding)."""
import argparse
import json
import os
import subprocess
import sys
import tempfile


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ctxpar", required=True, help="the ctxpar command (build/ctxpar)")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--mask", default="causal", choices=("none", "causal"))
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    if min(a.seq, a.heads, a.head_dim) < 1:
        p.error("--seq, --heads and --head-dim must be >= 1")
    if not os.access(a.ctxpar, os.X_OK):
        p.error(f"--ctxpar {a.ctxpar} is not an executable (build it: bash scripts/build.sh)")
    try:
        import numpy as np
        import torch
    except ImportError as e:
        sys.exit(f"bf16_accuracy.py: needs torch and NumPy in {sys.executable}: {e}")

    causal = a.mask == "causal"
    gen = torch.Generator().manual_seed(a.seed)
    shape = (1, a.seq, a.heads, a.head_dim)  # ctxpar's [B, T, H, D]
    # bf16 values, kept as float32 arrays for the CLI and float64 for the reference.
    x = {n: torch.randn(shape, generator=gen).to(torch.bfloat16) for n in ("q", "k", "v", "do")}

    # fp64 reference, per head: O = softmax(q k^T / sqrt(D) + mask) v and its gradients.
    scale = a.head_dim ** -0.5
    ref = {n: np.zeros(shape) for n in ("out", "dq", "dk", "dv")}
    f64 = {n: t.double().numpy()[0] for n, t in x.items()}  # [T, H, D]
    tri = np.triu(np.ones((a.seq, a.seq), dtype=bool), 1)
    for h in range(a.heads):
        q, k, v, do = (f64[n][:, h, :] for n in ("q", "k", "v", "do"))
        s = q @ k.T * scale
        if causal:
            s[tri] = -np.inf
        pm = np.exp(s - s.max(axis=1, keepdims=True))
        pm /= pm.sum(axis=1, keepdims=True)
        o = pm @ v
        dp = do @ v.T
        ds = pm * (dp - (do * o).sum(axis=1, keepdims=True))
        ref["out"][0, :, h], ref["dv"][0, :, h] = o, pm.T @ do
        ref["dq"][0, :, h], ref["dk"][0, :, h] = ds @ k * scale, ds.T @ q * scale

    def errors(got):
        out = {}
        for n, r in ref.items():
            g = np.asarray(got[n], dtype=np.float64).reshape(r.shape)
            top = float(np.abs(r).max())
            out[n] = dict(max_abs_over_max_ref=float(np.abs(g - r).max()) / top,
                          rms_over_max_ref=float(np.sqrt(((g - r) ** 2).mean())) / top)
        return out

    # ctxpar: the CLI on .npy files of the same bf16 values (exactly representable in float32).
    with tempfile.TemporaryDirectory() as tmp:
        for n, t in x.items():
            np.save(os.path.join(tmp, n + ".npy"), t.float().numpy())
        outdir = os.path.join(tmp, "out")
        cmd = [a.ctxpar, "attention", "--q", f"{tmp}/q.npy", "--k", f"{tmp}/k.npy",
               "--v", f"{tmp}/v.npy", "--do", f"{tmp}/do.npy", "--dtype", "bf16",
               "--mask", a.mask, "--out", outdir]
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0:
            sys.exit(f"bf16_accuracy.py: {' '.join(cmd)} failed: {run.stderr.strip()}")
        mine = {n: np.load(os.path.join(outdir, n + ".npy")) for n in ref}

    # torch: its own bf16 path, [B, H, T, D].
    tq, tk, tv = (x[n].transpose(1, 2).contiguous().requires_grad_() for n in ("q", "k", "v"))
    o = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
    o.backward(x["do"].transpose(1, 2).contiguous())
    theirs = {"out": o.detach().transpose(1, 2).float().numpy(),
              "dq": tq.grad.transpose(1, 2).float().numpy(),
              "dk": tk.grad.transpose(1, 2).float().numpy(),
              "dv": tv.grad.transpose(1, 2).float().numpy()}

    result = dict(seq=a.seq, heads=a.heads, head_dim=a.head_dim, mask=a.mask,
                  torch_version=torch.__version__, ctxpar=errors(mine), torch_bf16=errors(theirs))
    print(json.dumps(result))
    worst = max(e["max_abs_over_max_ref"] for side in ("ctxpar", "torch_bf16")
                for e in result[side].values())
    return 1 if worst > 0.05 else 0


if __name__ == "__main__":
    sys.exit(main())

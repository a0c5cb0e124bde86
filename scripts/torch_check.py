#!/usr/bin/python3
"""Independent check of `ctxpar train` against PyTorch (float64).

Runs `ctxpar train --steps 1 --dump-grads FILE` (a safetensors file with the weights, the
batch and the gradients of that step, after the all-reduce over the context group), rebuilds
the same model in PyTorch from the weights, runs the same batch on ONE device with plain
materialised causal attention, and compares the loss and every gradient.

Tolerances (ours is fp32, PyTorch runs in float64):
  loss:            |ours - torch| <= 1e-5 * |torch|
  each gradient:   max |ours - torch| <= 1e-4 * max |torch| + 1e-8   (per tensor)
(observed: ~1e-9 relative on the loss, <= ~1e-6 on the gradients)

Exit codes: 0 pass, 1 a comparison failed, 77 skipped (no torch under this python).
Usage: scripts/torch_check.py --ctxpar build/ctxpar [--workdir DIR]
"""
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

try:
    import numpy as np
    import torch
except ImportError as e:  # pragma: no cover
    print(f"torch_check: SKIPPED: {e} (install python3-torch and python3-numpy; "
          f"run with /usr/bin/python3)")
    sys.exit(77)

DTYPES = {"F32": np.float32, "U8": np.uint8, "F64": np.float64, "I64": np.int64}


def read_safetensors(path):
    """Reads a safetensors file with NumPy only: 8-byte LE length, JSON header, raw data."""
    with open(path, "rb") as f:
        blob = f.read()
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8:8 + n])
    meta = header.pop("__metadata__", {})
    base = 8 + n
    if "checksum" in meta:  # docs/training.md, "Checksum": recomputed independently here
        rest = {k: v for k, v in meta.items() if k != "checksum"}
        summed = dict(header, **({"__metadata__": rest} if rest else {}))
        h = 0xcbf29ce484222325
        for byte in json.dumps(summed, sort_keys=True, separators=(",", ":"),
                               ensure_ascii=False).encode() + blob[base:]:
            h = ((h ^ byte) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
        if meta["checksum"] != f"fnv1a64:{h:016x}":
            sys.exit(f"{path}: checksum {meta['checksum']} but the bytes give fnv1a64:{h:016x}")
    tensors = {}
    for name, t in header.items():
        a, b = t["data_offsets"]
        arr = np.frombuffer(blob[base + a:base + b], dtype=DTYPES[t["dtype"]])
        tensors[name] = arr.reshape(t["shape"]).copy()
    return meta, tensors


def rope(x, positions, base):
    """x [B, T, H, D]; pairs (2i, 2i+1) rotated by pos * base^(-2i/D)."""
    d = x.shape[-1]
    i = torch.arange(d // 2, dtype=torch.float64)
    theta = base ** (-2.0 * i / d)
    ang = positions.to(torch.float64)[:, None] * theta[None, :]  # [T, D/2]
    c, s = torch.cos(ang)[None, :, None, :], torch.sin(ang)[None, :, None, :]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x0 * c - x1 * s
    out[..., 1::2] = x0 * s + x1 * c
    return out


def rmsnorm(x, w, eps):
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w


def model_loss(p, inputs, labels, weight, cfg):
    L, Hq, Hkv, D = cfg["layers"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    eps, base = cfg["norm_eps"], cfg["rope_base"]
    B, T = inputs.shape
    pos = torch.arange(T)
    x = p["embed"][inputs.long()]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for l in range(L):
        w = lambda n: p[f"layers.{l}.{n}"]
        xn = rmsnorm(x, w("attn_norm"), eps)
        q = rope((xn @ w("wq").T).view(B, T, Hq, D), pos, base)
        k = rope((xn @ w("wk").T).view(B, T, Hkv, D), pos, base)
        v = (xn @ w("wv").T).view(B, T, Hkv, D)
        rep = Hq // Hkv  # query head h reads kv head h // rep
        k = k.repeat_interleave(rep, dim=2)
        v = v.repeat_interleave(rep, dim=2)
        s = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(D)
        s = s.masked_fill(~causal, float("-inf"))
        a = torch.einsum("bhij,bjhd->bihd", torch.softmax(s, dim=-1), v).reshape(B, T, Hq * D)
        x = x + a @ w("wo").T
        xn = rmsnorm(x, w("mlp_norm"), eps)
        h = torch.nn.functional.silu(xn @ w("w1").T) * (xn @ w("w3").T)
        x = x + h @ w("w2").T
    logits = rmsnorm(x, p["final_norm"], eps) @ p["embed"].T
    ce = torch.nn.functional.cross_entropy(logits.reshape(B * T, -1), labels.long().reshape(-1),
                                           reduction="none")
    wt = weight.reshape(-1).to(torch.float64)
    return (ce * wt).sum() / wt.sum()


def check(ctxpar, workdir, name, extra, steps=1):
    dump = os.path.join(workdir, f"{name}.safetensors")
    cmd = [ctxpar, "train", "--steps", str(steps), "--dump-grads", dump, "--quiet",
           "--threads", "1"] + extra
    print("torch_check:", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    meta, t = read_safetensors(dump)
    cfg = {k: int(meta[k]) for k in ("layers", "heads", "kv_heads", "head_dim")}
    cfg["norm_eps"] = float(meta["norm_eps"])
    cfg["rope_base"] = float(meta["rope_base"])
    names = [n[len("grad."):] for n in t if n.startswith("grad.")]
    params = {n: torch.tensor(t[n], dtype=torch.float64, requires_grad=True) for n in names}
    loss = model_loss(params, torch.tensor(t["batch.inputs"]), torch.tensor(t["batch.labels"]),
                      torch.tensor(t["batch.weight"]), cfg)
    loss.backward()
    ours = float(meta["loss"])
    ok = True
    rel = abs(ours - loss.item()) / abs(loss.item())
    print(f"  loss: ours {ours:.10f} torch {loss.item():.10f} rel diff {rel:.2e} (tol 1e-5)")
    ok &= rel <= 1e-5
    worst = 0.0
    for n in names:
        g_t = params[n].grad.numpy()
        g_o = t["grad." + n].astype(np.float64)
        err = float(np.abs(g_o - g_t).max())
        scale = float(np.abs(g_t).max())
        good = err <= 1e-4 * scale + 1e-8
        worst = max(worst, err / (scale + 1e-30))
        if not good:
            print(f"  FAIL grad {n}: max err {err:.3e}, max |grad| {scale:.3e}")
        ok &= good
    print(f"  {len(names)} gradients: worst max-err / max-|grad| = {worst:.2e} (tol 1e-4)")
    return ok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctxpar", required=True, help="path of the ctxpar binary")
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        work = args.workdir or tmp
        os.makedirs(work, exist_ok=True)
        model = ["--layers", "2", "--dim", "32", "--heads", "4", "--kv-heads", "2",
                 "--head-dim", "16", "--hidden", "48", "--batch", "2", "--seed", "5"]
        # Weights after init are small; a few steps of training are not needed: gradients of
        # step 1 already exercise every path. The data file gives loss on every token.
        text = os.path.join(work, "text.txt")
        with open(text, "wb") as f:
            f.write((b"context parallelism splits the sequence across ranks; " * 40))
        ok = check(args.ctxpar, work, "copy_ring_zigzag",
                   model + ["--seq", "64", "--ranks", "2", "--strategy", "ring",
                            "--layout", "zigzag", "--copy-len", "16"])
        ok &= check(args.ctxpar, work, "text_allgather_striped",
                    model + ["--seq", "128", "--ranks", "4", "--strategy", "allgather",
                             "--layout", "striped", "--data", text])
        ok &= check(args.ctxpar, work, "text_single",
                    model + ["--seq", "96", "--ranks", "1", "--data", text])
        # Trained weights (attention far from uniform): 40 steps, checkpoint, then the dump of
        # step 41 resumed from it, on 4 ranks with ring + contiguous.
        ck = os.path.join(work, "trained.safetensors")
        subprocess.run([args.ctxpar, "train", "--steps", "40", "--save", ck, "--quiet",
                        "--lr", "1e-2"] + model + ["--seq", "64", "--ranks", "1",
                                                   "--copy-len", "16"], check=True)
        ok &= check(args.ctxpar, work, "trained_ring_contiguous",
                    model + ["--seq", "64", "--ranks", "4", "--layout", "contiguous",
                             "--copy-len", "16", "--resume", ck, "--lr", "1e-2"], steps=41)
    print("torch_check:", "PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

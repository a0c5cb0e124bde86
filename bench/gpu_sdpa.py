#!/usr/bin/env python3
"""One rank of ctxpar against torch's F.scaled_dot_product_attention on one GPU, with each
backend torch offers (cuDNN, flash, efficient; torch.nn.attention.sdpa_kernel): bf16, B = 1,
Hq = 32, Hkv = 8, D = 128, T in {8K, 32K, 128K}, causal and full, forward and forward+backward.
Goal: ctxpar >= 0.9x the fastest backend.

NEVER RUN: written against ctxpar's documented Python API (docs/python.md: ctxpar.attention,
ctxpar.attention_backward, q/k/v [B, T, H, D]) taking CUDA tensors, before any GPU was lent.
  gpu_sdpa.py OUT.json [BUDGET_S]            scripts/gpu_check.sh: every T, causal and full
  gpu_sdpa.py --torch-only --seqs 8192 OUT.json [BUDGET_S]
      scripts/gpu_first.sh: torch's backends only, causal (its python has no ctxpar package:
      the window times the bundle's `ctxpar attention` at the same shape beside it)
  gpu_sdpa.py --table RUNS_DIR               gpu_first.sh's summary: both, side by side
A case that fails (a backend that refuses the shape, ctxpar refusing CUDA tensors, out of
memory) is recorded with its error; the others still run. Each row is printed (one JSON line)
as soon as it is measured.
"""
import argparse
import glob
import json
import os
import sys
import time

B, HQ, HKV, D = 1, 32, 8, 128
SEQS = [8 * 1024, 32 * 1024, 128 * 1024]
BACKENDS = {"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION",
            "efficient": "EFFICIENT_ATTENTION"}  # torch.nn.attention.SDPBackend's names


def load_torch():
    """torch on first need: --table reads files only (the summary of a window, any python)."""
    global torch, F, SDPBackend, sdpa_kernel
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel


def timed(fn, repeats):
    fn()  # warm-up (graph builds, autotuning)
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 1000)
    return best


def torch_case(backend, q, k, v, causal, backward):
    # SDPA takes [B, H, T, D]; GQA by enable_gqa where the backend has it, else K/V expanded.
    qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_(backward) for x in (q, k, v))
    note = "enable_gqa"

    def fwd(gqa):
        with sdpa_kernel(getattr(SDPBackend, BACKENDS[backend])):
            if gqa:
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal,
                                                      enable_gqa=True)
            rep = HQ // HKV
            return F.scaled_dot_product_attention(qt, kt.repeat_interleave(rep, 1),
                                                  vt.repeat_interleave(rep, 1), is_causal=causal)
    try:
        fwd(True)
        gqa = True
    except RuntimeError:
        gqa, note = False, "K/V expanded to Hq heads (no enable_gqa on this backend)"
    if not backward:
        return timed(lambda: fwd(gqa), 3), note
    dout = torch.randn_like(qt)
    return timed(lambda: torch.autograd.grad(fwd(gqa), (qt, kt, vt), dout), 3), note


def ctxpar_case(q, k, v, causal, backward):
    import ctxpar
    mask = "causal" if causal else "none"
    if not backward:
        return timed(lambda: ctxpar.attention(q, k, v, ranks=1, mask=mask), 3)
    dout = torch.randn_like(q)

    def both():
        out, lse = ctxpar.attention(q, k, v, ranks=1, mask=mask)
        ctxpar.attention_backward(q, k, v, out, lse, dout, ranks=1, mask=mask)
    return timed(both, 3)


def table(runs):
    """The summary's side-by-side table of gpu_first.sh's sdpa stage, from its files in RUNS."""
    lines = []
    for path in sorted(glob.glob(os.path.join(runs, "sdpa-torch-*.json"))):
        t = int(path.rsplit("-", 1)[1].split(".")[0])
        with open(path) as f:
            rows = json.load(f)["rows"]
        for row in rows:
            cells = ["%s %.4g s" % (n, row[n]["seconds"]) if "seconds" in row[n] else
                     "%s: %s" % (n, row[n].get("error", "?")[:60]) for n in BACKENDS if n in row]
            pass_ = row["pass"]
            ours = os.path.join(runs, "sdpa-ctxpar_T=%d_%s.out" % (t, pass_))
            mine = "ctxpar not run"
            try:
                with open(ours) as f:
                    j = json.load(f)
                mine = "ctxpar %.4g s" % (j["forward_seconds"] + j.get("backward_seconds", 0))
            except (OSError, ValueError, KeyError):
                pass
            lines.append("  T=%d causal %s: %s; %s" % (t, pass_, ", ".join(cells), mine))
    if lines:
        print("\nctxpar (the command: host tensors staged to the GPU each call) against torch's "
              "SDPA (GPU tensors), bf16, B=1, Hq=32, Hkv=8, D=128, best of 3:")
        print("\n".join(lines))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="OUT.json, or RUNS_DIR with --table")
    ap.add_argument("budget", nargs="?", type=float, default=600.0)
    ap.add_argument("--torch-only", action="store_true")
    ap.add_argument("--seqs", default=",".join(str(t) for t in SEQS))
    ap.add_argument("--table", action="store_true")
    a = ap.parse_args()
    if a.table:
        return table(a.out)
    load_torch()
    deadline = time.time() + a.budget
    rows = []
    info = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "cudnn": torch.backends.cudnn.version()}
    names = list(BACKENDS) + ([] if a.torch_only else ["ctxpar"])
    for t in [int(x) for x in a.seqs.split(",")]:
        q = torch.randn(B, t, HQ, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(B, t, HKV, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(B, t, HKV, D, device="cuda", dtype=torch.bfloat16)
        for causal in (True,) if a.torch_only else (True, False):
            for backward in (False, True):
                row = {"seq": t, "causal": causal, "pass": "fwd+bwd" if backward else "fwd"}
                for name in names:
                    if time.time() > deadline:
                        row[name] = {"error": "not run (budget spent)"}
                        continue
                    try:
                        if name == "ctxpar":
                            row[name] = {"seconds": ctxpar_case(q, k, v, causal, backward)}
                        else:
                            s, note = torch_case(name, q, k, v, causal, backward)
                            row[name] = {"seconds": s, "gqa": note}
                    except Exception as e:  # a refusal or OOM is a result, not the end
                        row[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                        torch.cuda.empty_cache()
                times = [row[n]["seconds"] for n in BACKENDS if "seconds" in row[n]]
                if times and "seconds" in row.get("ctxpar", {}):
                    row["ctxpar_vs_fastest"] = min(times) / row["ctxpar"]["seconds"]  # goal >= 0.9
                rows.append(row)
                print(json.dumps(row), flush=True)
        del q, k, v
        torch.cuda.empty_cache()
    with open(a.out, "w") as f:
        json.dump({"info": info, "goal": "ctxpar >= 0.9x the fastest backend", "rows": rows}, f,
                  indent=1)


if __name__ == "__main__":
    main()

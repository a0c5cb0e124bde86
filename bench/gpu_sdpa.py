#!/usr/bin/env python3
"""One rank of ctxpar against torch's F.scaled_dot_product_attention on one GPU, with each
backend torch offers (cuDNN, flash, efficient; torch.nn.attention.sdpa_kernel): bf16, B = 1,
Hq = 32, Hkv = 8, D = 128, T in {8K, 32K, 128K}, causal and full, forward and forward+backward.
Goal (issue 24): ctxpar >= 0.9x the fastest backend.

NEVER RUN: written against ctxpar's documented Python API (docs/python.md: ctxpar.attention,
ctxpar.attention_backward, q/k/v [B, T, H, D]) taking CUDA tensors, before any GPU was lent.
scripts/gpu_check.sh runs it:  gpu_sdpa.py OUT.json [BUDGET_S]
A case that fails (a backend that refuses the shape, ctxpar refusing CUDA tensors, out of
memory) is recorded with its error; the others still run.
"""
import json
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import ctxpar

B, HQ, HKV, D = 1, 32, 8, 128
SEQS = [8 * 1024, 32 * 1024, 128 * 1024]
BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


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
        with sdpa_kernel(BACKENDS[backend]):
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
    mask = "causal" if causal else "none"
    if not backward:
        return timed(lambda: ctxpar.attention(q, k, v, ranks=1, mask=mask), 3)
    dout = torch.randn_like(q)

    def both():
        out, lse = ctxpar.attention(q, k, v, ranks=1, mask=mask)
        ctxpar.attention_backward(q, k, v, out, lse, dout, ranks=1, mask=mask)
    return timed(both, 3)


def main():
    out_path = sys.argv[1]
    deadline = time.time() + (float(sys.argv[2]) if len(sys.argv) > 2 else 600)
    rows = []
    info = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "cudnn": torch.backends.cudnn.version(), "ctxpar": getattr(ctxpar, "__version__", "?")}
    for t in SEQS:
        q = torch.randn(B, t, HQ, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(B, t, HKV, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(B, t, HKV, D, device="cuda", dtype=torch.bfloat16)
        for causal in (True, False):
            for backward in (False, True):
                row = {"seq": t, "causal": causal, "pass": "fwd+bwd" if backward else "fwd"}
                for name in list(BACKENDS) + ["ctxpar"]:
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
                if times and "seconds" in row["ctxpar"]:
                    row["ctxpar_vs_fastest"] = min(times) / row["ctxpar"]["seconds"]  # goal >= 0.9
                rows.append(row)
                print(json.dumps(row), flush=True)
        del q, k, v
        torch.cuda.empty_cache()
    with open(out_path, "w") as f:
        json.dump({"info": info, "goal": "ctxpar >= 0.9x the fastest backend", "rows": rows}, f,
                  indent=1)


if __name__ == "__main__":
    main()

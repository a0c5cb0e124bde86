"""ctxpar.KVCache scenarios shared by test_inference.py (threads) and its launcher cases (run as
a script under mpirun / torchrun: `inference_case.py init`): B = 2 sequences of different
lengths are prefilled in pieces (forced modes), then decoded together token by token, and every
row any call returned is checked against the fp64 SDPA of the whole sequence (torch, one rank)
under the project's accuracy rule (conftest.check_close). Exit code 0 when every check holds."""
import os
import sys

import numpy as np
import torch
from torch.nn.functional import scaled_dot_product_attention as sdpa

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ctxpar  # noqa: E402
from conftest import check_close, visible  # noqa: E402

STORAGE_ROUNDING = {torch.bfloat16: 2.0 ** -8, torch.float32: 0.0}


def whole_problem(lengths, Hq=4, Hkv=2, D=16, dtype=torch.float32, seed=0):
    """Per sequence: q [1, N, Hq, D], k, v [1, N, Hkv, D] and document ids [N] (three
    documents of uneven sizes)."""
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for n in lengths:
        q, k, v = (torch.randn(1, n, h, D, generator=g).to(dtype) for h in (Hq, Hkv, Hkv))
        docs = torch.tensor([0] * (n // 3) + [1] * (n // 4) + [2] * (n - n // 3 - n // 4),
                            dtype=torch.int32)
        seqs.append((q, k, v, docs))
    return seqs


def mask_rule(mask, n, docs):
    """[n, n] bool visibility of the mask text the cache uses (causal / causal+window:L,0 /
    causal+documents)."""
    ok = visible(n, "causal")
    if "window" in mask:
        left = int(mask.split(":")[1].split(",")[0])
        ok &= visible(n, ("window", left, -1))
    if "documents" in mask:
        ok &= visible(n, document_ids=docs)
    return ok


def reference(q, k, v, ok, dtype):
    """Attention of every row over the whole sequence in `dtype`: fp64 through torch's SDPA
    (the reference), fp32 by a plain softmax (the naive computation the rule scales from)."""
    g = q.shape[2] // k.shape[2]
    qq, kk, vv = (x.to(dtype).transpose(1, 2) for x in (q, k.repeat_interleave(g, 2),
                                                        v.repeat_interleave(g, 2)))
    if dtype == torch.float64:
        return sdpa(qq, kk, vv, attn_mask=ok).transpose(1, 2)
    s = (qq @ kk.transpose(-1, -2)) * q.shape[3] ** -0.5
    return (torch.softmax(s.masked_fill(~ok, float("-inf")), -1) @ vv).transpose(1, 2)


def run(comm, mask="causal", dtype=torch.float32, modes=("pass-kv", "pass-q"),
        cuts=((40, 17), (23,)), decode_steps=6, block=8, **options):
    """Prefills sequence s in the pieces cuts[s] (mode cycling through `modes`), then decodes
    both sequences together decode_steps times. Returns (rows, modes_ran, seqs, cache): rows[s]
    [1, N, Hq, D] of every output row, in order; seqs the whole problem (whole_problem); the
    cache after the run. options: more KVCache keywords (bf16_tier=...)."""
    lengths = [sum(c) + decode_steps for c in cuts]
    seqs = whole_problem(lengths, dtype=dtype)
    cache = ctxpar.KVCache(comm, kv_heads=2, head_dim=16, sequences=len(cuts),
                           dtype="bfloat16" if dtype == torch.bfloat16 else "float32",
                           mask=mask, block=block, **options)
    docs = "documents" in mask
    rows, ran = [[] for _ in cuts], []
    for s, pieces in enumerate(cuts):
        q, k, v, d = seqs[s]
        at = 0
        for i, n in enumerate(pieces):
            sl = slice(at, at + n)
            out, _ = cache.prefill(q[:, sl], k[:, sl], v[:, sl], seq=s,
                                   mode=modes[i % len(modes)],
                                   document_ids=d[sl] if docs else None)
            ran.append(cache.last_stats["mode"])
            rows[s].append(out)
            at += n
    for step in range(decode_steps):
        idx = [sum(c) + step for c in cuts]
        pick = lambda j: torch.cat([seqs[s][j][:, i:i + 1] for s, i in enumerate(idx)])  # noqa
        ids = torch.stack([seqs[s][3][i] for s, i in enumerate(idx)]).reshape(-1, 1)
        out, _ = cache.decode(pick(0), pick(1), pick(2), document_ids=ids if docs else None)
        for s in range(len(cuts)):
            rows[s].append(out[s:s + 1])
    assert cache.lengths == lengths, (cache.lengths, lengths)
    return [torch.cat(r, 1) for r in rows], ran, seqs, cache


def check(rows, seqs, mask, dtype):
    for s, (got, (q, k, v, d)) in enumerate(zip(rows, seqs)):
        ok = mask_rule(mask, q.shape[1], d)
        check_close(f"sequence {s} ({mask}, {dtype})", got.float(),
                    reference(q, k, v, ok, torch.float64),
                    reference(q, k, v, ok, torch.float32), STORAGE_ROUNDING[dtype])


if __name__ == "__main__":
    comm = ctxpar.init(timeout_s=60)
    for mask in ("causal", "causal+window:12,0", "causal+documents"):
        for dtype in (torch.float32, torch.bfloat16):
            rows, ran, seqs, _ = run(comm, mask, dtype)
            check(rows, seqs, mask, dtype)
            assert ran == ["pass-kv", "pass-q", "pass-kv"], ran
    print(f"rank {comm.rank} of {comm.size}: {comm.transport} ok", flush=True)

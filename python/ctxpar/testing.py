"""A correctness oracle for other context-parallel implementations.

    report = ctxpar.testing.check_shards(out_shards, q, k, v, causal=True,
                                         convention="ring-flash-attn")
    print(report)          # worst rows: rank, local row, global token, batch, head, error
    assert report.ok

`out_shards[r]` is rank r's attention output as the implementation wrote it (e.g. saved with
torch.save by a torchrun job); q, k, v are the whole inputs in the same convention. The shards
are put back in global token order (unshard) and compared with ctxpar's fp64 reference under
the project's rule: max|out - fp64| <= 2 * max|naive fp32 - fp64| + 1e-5 * max(1, |fp64|),
plus one rounding of the output's storage type (bf16 2^-8, fp16 2^-11, relative).

Conventions (layout of the shards, and of q, k, v):
  ring-flash-attn     [B, T, H, D]; zigzag: 2P chunks, rank r holds chunks r and 2P-1-r
                      (zigzag_ring_flash_attn; its stripe variant is layout="striped")
  transformer-engine  [T, B, H, D] (qkv_format "sbhd"; pass qkv_format="bshd" for
                      [B, T, H, D]); the same zigzag (load-balanced causal CP)
  torch               [B, H, T, D] (torch.distributed.tensor.experimental.context_parallel);
                      the head-tail load balancer = zigzag (layout="contiguous" without
                      load balancing)
  ctxpar              [B, T, H, D], any ctxpar layout
"""
from dataclasses import dataclass, field

import numpy as np

from . import _checks
from . import _ctxpar
from . import layout as _layout
from ._arrays import framework
from ._attention import job_args

CONVENTIONS = {
    "ring-flash-attn": ("bshd", "zigzag"),
    "transformer-engine": ("sbhd", "zigzag"),
    "torch": ("bhsd", "zigzag"),
    "ctxpar": ("bshd", "zigzag"),
}
_TO_BSHD = {"bshd": (0, 1, 2, 3), "sbhd": (1, 0, 2, 3), "bhsd": (0, 2, 1, 3)}
_STORAGE_ROUNDING = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}


@dataclass
class ShardReport:
    ok: bool
    max_error: float
    bound: float
    naive32_error: float
    layout: str
    worst: list = field(default_factory=list)  # dicts: rank, local_row, token, batch, head, error

    def __str__(self):
        head = (f"check_shards: {'ok' if self.ok else 'FAILED'}: max|out - fp64| = "
                f"{self.max_error:.3g}, bound {self.bound:.3g} (naive fp32 error "
                f"{self.naive32_error:.3g}), layout {self.layout}")
        rows = [f"  rank {w['rank']} local row {w['local_row']} (token {w['token']}) batch "
                f"{w['batch']} head {w['head']}: error {w['error']:.3g}" for w in self.worst]
        return "\n".join([head, "  worst rows:"] + rows if rows else [head])


def _as_numpy(x, name):
    """(float32 NumPy array, dtype name) of a NumPy array or torch tensor."""
    if framework(x, name) == "torch":
        return x.detach().cpu().float().numpy(), str(x.dtype).replace("torch.", "")
    return np.asarray(x, dtype=np.float32), str(x.dtype)


def check_shards(out_shards, q, k, v, layout=None, causal=False, convention="ring-flash-attn",
                 *, qkv_format=None, mask=None, document_ids=None, scale=None, worst=5):
    """Unshards per-rank outputs and compares them with the fp64 reference; returns a
    ShardReport (falsy fields say what is wrong; str() prints the worst rows)."""
    worst = _checks.whole("worst", worst, 0, 1 << 31)
    if convention not in CONVENTIONS:
        raise ValueError(f"convention: expected one of {sorted(CONVENTIONS)}, got {convention!r}")
    fmt, default_layout = CONVENTIONS[convention]
    fmt = qkv_format or fmt
    if fmt not in _TO_BSHD:
        raise ValueError(f"qkv_format: expected one of {sorted(_TO_BSHD)}, got {fmt!r}")
    layout = layout or default_layout
    perm = _TO_BSHD[fmt]
    if not out_shards:
        raise ValueError("out_shards: expected one output per rank, got none")

    def bshd(x, name):
        a, dt = _as_numpy(x, name)
        if a.ndim != 4:
            raise ValueError(f"{name}: expected a 4-D {fmt} tensor, got shape {a.shape}")
        return np.ascontiguousarray(a.transpose(perm)), dt

    qs, ks, vs = (bshd(x, n)[0] for x, n in ((q, "q"), (k, "k"), (v, "v")))
    shards = [bshd(s, f"out_shards[{r}]") for r, s in enumerate(out_shards)]
    ranks = len(shards)
    B, T, H, D = qs.shape
    want = (B, T // ranks, H, D)
    for r, (s, _) in enumerate(shards):
        if s.shape != want:
            raise ValueError(f"out_shards[{r}]: expected {fmt} shape of T / P = {T} / {ranks} "
                             f"tokens, {want} as [B, T, H, D], got {s.shape}")
    out = _layout.unshard_all([s for s, _ in shards], layout=layout, seq_dim=1)

    args = job_args(mask=mask if mask is not None else ("causal" if causal else "none"),
                    document_ids=document_ids, scale=scale)
    ref, _ = _ctxpar._reference(qs, ks, vs, args)
    naive, _ = _ctxpar._reference(qs, ks, vs, args, naive32=True)
    row_error = np.abs(out - ref).max(axis=3)  # [B, T, H]
    max_error = float(row_error.max())
    naive_error = float(np.abs(naive - ref).max())
    ref_max = float(np.abs(ref).max())
    # The project's rule, from its one home (ctxpar/reference.h), plus the storage rounding.
    bound = (_ctxpar._accuracy_tolerance(naive_error, ref_max)
             + _STORAGE_ROUNDING.get(shards[0][1], 0) * max(1.0, ref_max))
    ok = bool(np.isfinite(out).all()) and max_error <= bound

    owner, local_row = np.empty(T, np.int64), np.empty(T, np.int64)
    for r in range(ranks):
        pos = _layout.positions(T, ranks, r, layout)
        owner[pos], local_row[pos] = r, np.arange(len(pos))
    rows = []
    for flat in np.argsort(row_error, axis=None)[::-1][:worst]:
        b, t, h = np.unravel_index(flat, row_error.shape)
        rows.append(dict(rank=int(owner[t]), local_row=int(local_row[t]), token=int(t),
                         batch=int(b), head=int(h), error=float(row_error[b, t, h])))
    return ShardReport(ok, max_error, bound, naive_error, layout, rows)

"""Data-aware context parallelism (issue 37): balance, bytes and time of the balanced layout with
the needed exchange, against zigzag / striped rings and torch 2.15's per-document head-tail load
balancer, on packed long-tailed documents and a prefix tree.

    .venv/bin/python bench/data_aware.py [--ctxpar build/ctxpar] [--quick]

Documents: log-normal lengths (median 1,000 tokens, sigma 1.5, within [32, 32,768], multiples of
16 so torch's balancer can cut each into 2P pieces), packed until T: the long-tailed shape of web
and code corpora (most documents short, a few holding most tokens), as in WLB-LLM and
MagiAttention's packed-document benchmarks. Work = visible (query, key) pairs per rank, counted
exactly; bytes and times from `ctxpar attention --json` on the in-process transport."""
import argparse
import json
import subprocess
import sys
import time

import numpy as np

import ctxpar
from ctxpar import layout as cl


def lengths(tokens, seed):
    rng = np.random.default_rng(seed)
    out, total = [], 0
    while total < tokens:
        n = int(np.clip(rng.lognormal(np.log(1000), 1.5), 32, 32768)) // 16 * 16
        n = min(max(n, 16), tokens - total)
        out.append(n)
        total += n
    return out


def pair_work(lens, perm, ranks):
    """Visible pairs of each rank's queries under causal+documents: query i of a document that
    starts at s sees i - s + 1 keys."""
    starts = np.repeat(np.cumsum([0] + lens[:-1]), lens)
    seen = np.arange(sum(lens)) - starts + 1
    per = len(perm) // ranks
    return np.array([seen[perm[r * per:(r + 1) * per]].sum() for r in range(ranks)], float)


def tile_work(lens, perm, ranks, tile=64):
    """Kernel tiles each rank computes (the ring's cost): rank r's local tokens perm[r*Tl:...] in
    tiles of 64, a (query tile, key tile) pair computed unless causal or the documents hide it
    whole (include/ctxpar/mask_rules.h's rule on the tiles' position and document ranges)."""
    doc = np.repeat(np.arange(len(lens)), lens)[perm].reshape(-1, tile)
    pos = perm.reshape(-1, tile)
    lo, hi, dlo, dhi = pos.min(1), pos.max(1), doc.min(1), doc.max(1)
    n = len(lo)
    per = n // ranks
    seen = ((lo[None, :] <= hi[:, None]) & (dlo[None, :] <= dhi[:, None]) &
            (dhi[None, :] >= dlo[:, None])).sum(1)
    return np.array([seen[r * per:(r + 1) * per].sum() for r in range(ranks)], float)


def torch_per_document(lens, ranks):
    import torch
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import (
        _PerDocumentHeadTailLoadBalancer)
    lb = _PerDocumentHeadTailLoadBalancer([lens], ranks, torch.device("cpu"))
    return lb._generate_indices(restore=False)[0].numpy()


def fixed(layout, tokens, ranks):
    return cl.permutation(tokens, ranks, layout)[0]


def run(exe, args):
    r = subprocess.run([exe, "attention", "--json", *args], capture_output=True, text=True,
                       check=False)
    if r.returncode != 0:
        sys.exit(f"ctxpar attention {' '.join(args)} failed:\n{r.stderr}")
    return json.loads(r.stdout)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctxpar", default="build/ctxpar")
    ap.add_argument("--quick", action="store_true", help="T = 64K only, P = 4")
    o = ap.parse_args()
    shapes = [(65536, 4)] if o.quick else [(65536, 4), (65536, 8), (131072, 4), (131072, 8)]
    print("## Balance: busiest rank / mean, in visible pairs and in kernel tiles (causal + "
          "documents); tiles: total ÷ balanced's total in brackets. Torch's busiest rank's tiles ÷ "
          "balanced's busiest rank's: what sets the step time (torch's layout computes more tiles "
          "in all, so a ratio of 1.000 can still be more work); solve: the balanced layout's "
          "permutation, best of 3\n")
    print("| T | P | docs | contiguous | zigzag | striped | torch per-doc head-tail | balanced | "
          "torch busiest tiles ÷ balanced's | solve ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    batches = {}
    for tokens, ranks in shapes:
        lens = lengths(tokens, seed=tokens + 1)
        batches[(tokens, ranks)] = lens
        ids = np.repeat(np.arange(len(lens)), lens).astype(np.int32)
        solve = []
        for _ in range(3):
            start = time.perf_counter()
            ours = cl.permutation(tokens, ranks, "balanced", mask="causal", document_ids=ids)[0]
            solve.append(time.perf_counter() - start)
        cols, tiles = [], []
        for perm in (fixed("contiguous", tokens, ranks), fixed("zigzag", tokens, ranks),
                     fixed("striped", tokens, ranks), torch_per_document(lens, ranks), ours):
            w, t = pair_work(lens, perm, ranks), tile_work(lens, perm, ranks)
            tiles.append(t)
            cols.append(f"{w.max() / w.mean():.3f} / {t.max() / t.mean():.3f}")
        cols = [f"{c} [{t.sum() / tiles[-1].sum():.2f}]" for c, t in zip(cols, tiles)]
        print(f"| {tokens} | {ranks} | {len(lens)} | " + " | ".join(cols) +
              f" | {tiles[3].max() / tiles[-1].max():.2f} | {min(solve) * 1e3:.0f} |")

    print("\n## Bytes moved, forward + backward, all ranks (H 1, D 16: bytes scale with H x D)\n")
    print("| T | P | striped ring | zigzag ring | balanced + needed | ÷ striped ring |")
    print("|---|---|---|---|---|---|")
    for tokens, ranks in shapes:
        mask = "causal+documents:" + ",".join(map(str, batches[(tokens, ranks)]))
        sent = []
        for layout, exchange in (("striped", "ring"), ("zigzag", "ring"), ("balanced", "needed")):
            j = run(o.ctxpar, ["--seq", str(tokens), "--ranks", str(ranks), "--heads", "1",
                               "--head-dim", "16", "--mask", mask, "--backward", "--layout",
                               layout, "--exchange", exchange])
            sent.append(sum(r["bytes_sent"] for r in j["ranks"]))
        print(f"| {tokens} | {ranks} | " + " | ".join(f"{b / 2**20:.1f} MiB" for b in sent) +
              f" | {sent[2] / sent[0]:.2f} |")

    tokens, ranks = shapes[0]
    print(f"\n## Time, in-process transport (T {tokens}, P {ranks}, H 8 / KV 1, D 64, fwd + bwd)\n")
    print("| layout + exchange | fwd + bwd s | best ring ÷ this | balance (FLOPs) |")
    print("|---|---|---|---|")
    mask = "causal+documents:" + ",".join(map(str, batches[(tokens, ranks)]))
    rows = {}
    for name, extra in (("striped ring", ["--layout", "striped", "--exchange", "ring"]),
                        ("zigzag ring", ["--layout", "zigzag", "--exchange", "ring"]),
                        ("balanced needed", ["--layout", "balanced", "--exchange", "needed"])):
        j = run(o.ctxpar, ["--seq", str(tokens), "--ranks", str(ranks), "--heads", "8",
                           "--kv-heads", "1", "--head-dim", "64", "--mask", mask, "--backward",
                           *extra])
        flops = [r["attention_flops"] for r in j["ranks"]]
        rows[name] = (j["forward_seconds"] + j["backward_seconds"],
                      max(flops) / (sum(flops) / len(flops)))
    best = min(rows["striped ring"][0], rows["zigzag ring"][0])
    for name, (secs, bal) in rows.items():
        print(f"| {name} | {secs:.2f} | {best / secs:.2f}x | {bal:.2f} |")

    print("\n## Prefix tree: an 8K prompt and eight 2K responses (P = 4, fwd + bwd)\n")
    tree = run(o.ctxpar, ["--seq", "24576", "--ranks", "4", "--heads", "8", "--kv-heads", "1",
                          "--head-dim", "64", "--backward", "--check", "--mask",
                          "prefix-tree:8192," + ",".join(["2048"] * 8)])
    flat = run(o.ctxpar, ["--seq", str(8 * 10240), "--ranks", "4", "--heads", "8", "--kv-heads",
                          "1", "--head-dim", "64", "--backward", "--mask",
                          "causal+documents:" + ",".join(["10240"] * 8)])
    t_tree = tree["forward_seconds"] + tree["backward_seconds"]
    t_flat = flat["forward_seconds"] + flat["backward_seconds"]
    print("| run | tokens | fwd + bwd s | check |")
    print("|---|---|---|---|")
    print(f"| prefix tree (balanced, needed) | 24,576 | {t_tree:.2f} | "
          f"{'passed' if tree['check_passed'] else 'FAILED'}, max err "
          f"{tree['max_abs_err']:.2g} |")
    print(f"| prompt repeated per response (causal+documents) | 81,920 | {t_flat:.2f} | - |")
    print(f"\nprefix tree {t_flat / t_tree:.2f}x faster than repeating the prompt")


if __name__ == "__main__":
    main()

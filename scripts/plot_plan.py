#!/usr/bin/python3
"""Predicted (ctxpar plan --hardware local) against measured (ctxpar attention) ring times.

For each P and link speed: `ctxpar plan` measures our kernel with P threads at once and models
the threads transport's simulated link, then `ctxpar attention` runs the same ring for real.
Writes the figures as JSON, prints the markdown table of docs/plan.md and draws the plot.

  /usr/bin/python3 scripts/plot_plan.py --ctxpar build/ctxpar              # run and plot
  /usr/bin/python3 scripts/plot_plan.py --from docs/plan_local.json         # plot saved runs
"""
import argparse
import json
import subprocess
import sys


def run_json(cmd):
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def one_case(ctxpar, ranks, link_gbps, block, heads, head_dim, repeats):
    seq = block * ranks
    shape = ["--heads", str(heads), "--head-dim", str(head_dim), "--seq", str(seq),
             "--layout", "zigzag", "--mask", "causal", "--dtype", "fp32"]
    plan_cmd = [ctxpar, "plan", "--hardware", "local", "--cp", str(ranks), "--layers", "1",
                "--hidden", str(heads * head_dim), "--kv-heads", str(heads), "--ffn", "512",
                "--vocab", "1000", "--link-gbps", str(link_gbps), "--json"] + shape
    # The machine is shared and its load drifts: the plan measures just before and just
    # after the run, and the prediction is the mean of the two.
    before = run_json(plan_cmd)
    meas = run_json([ctxpar, "attention", "--ranks", str(ranks), "--backward", "--json",
                     "--link-gbps", str(link_gbps), "--repeats", str(repeats)] + shape)
    after = run_json(plan_cmd)
    plan = before
    ring = {k: (before["ring_layer"][k] + after["ring_layer"][k]) / 2
            for k in ("forward_seconds", "seconds", "exposed_comm_seconds")}
    plan["hardware"]["flops"] = (before["hardware"]["flops"] + after["hardware"]["flops"]) / 2
    return {
        "ranks": ranks, "link_gbps": link_gbps, "seq": seq, "block_tokens": block,
        "heads": heads, "head_dim": head_dim,
        "kernel_gflops_per_rank": plan["hardware"]["flops"] / 1e9,
        "min_block_tokens": plan["min_block_tokens"],
        "predicted_total_before": before["ring_layer"]["seconds"],
        "predicted_total_after": after["ring_layer"]["seconds"],
        "predicted_forward": ring["forward_seconds"],
        "predicted_total": ring["seconds"],
        "predicted_exposed": ring["exposed_comm_seconds"],
        "measured_forward": meas["forward_seconds"],
        "measured_total": meas["forward_seconds"] + meas["backward_seconds"],
        "measured_wait_max": max(r["comm_wait_seconds"] for r in meas["ranks"]),
    }


def table(rows):
    lines = ["| P | link GB/s | regime | kernel GFLOP/s per rank | predicted fwd s | measured fwd s "
             "| predicted fwd+bwd s | measured fwd+bwd s | error |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        regime = "transfer" if r["block_tokens"] < r["min_block_tokens"] else "compute"
        err = r["predicted_total"] / r["measured_total"] - 1
        lines.append(f"| {r['ranks']} | {r['link_gbps']:g} | {regime} | "
                     f"{r['kernel_gflops_per_rank']:.2f} | {r['predicted_forward']:.3f} | "
                     f"{r['measured_forward']:.3f} | {r['predicted_total']:.3f} | "
                     f"{r['measured_total']:.3f} | {100 * err:+.1f}% |")
    return "\n".join(lines)


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.8))
    links = sorted({r["link_gbps"] for r in rows}, reverse=True)
    markers = "os^v"
    for i, link in enumerate(links):
        sel = [r for r in rows if r["link_gbps"] == link]
        regime = "transfer" if sel[0]["block_tokens"] < sel[0]["min_block_tokens"] else "compute"
        label = f"link {link:g} GB/s ({regime}-dominated)"
        ax.scatter([r["measured_total"] for r in sel], [r["predicted_total"] for r in sel],
                   marker=markers[i % 4], s=50, label=label)
        for r in sel:
            ax.annotate(f"P={r['ranks']}", (r["measured_total"], r["predicted_total"]),
                        textcoords="offset points", xytext=(6, -4 - 8 * i), fontsize=8)
        bx.plot([r["ranks"] for r in sel],
                [100 * (r["predicted_total"] / r["measured_total"] - 1) for r in sel],
                marker=markers[i % 4], label=label)
    lo = min(min(r["measured_total"], r["predicted_total"]) for r in rows) / 1.5
    hi = max(max(r["measured_total"], r["predicted_total"]) for r in rows) * 1.5
    ax.plot([lo, hi], [lo, hi], "k-", lw=1, label="predicted = measured")
    ax.fill_between([lo, hi], [0.85 * lo, 0.85 * hi], [1.15 * lo, 1.15 * hi], color="gray",
                    alpha=0.15, label="within 15%")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("measured: ctxpar attention, forward + backward (s)")
    ax.set_ylabel("predicted: ctxpar plan --hardware local (s)")
    ax.legend(loc="upper left", fontsize=8)
    ranks = sorted({r["ranks"] for r in rows})
    bx.axhspan(-15, 15, color="gray", alpha=0.15, label="within 15%")
    bx.axhline(0, color="k", lw=1)
    bx.set_xscale("log", base=2)
    bx.set_xticks(ranks)
    bx.set_xticklabels([str(p) for p in ranks])
    bx.set_ylim(-30, 30)
    bx.set_xlabel("ranks P (threads on this 2-core machine)")
    bx.set_ylabel("predicted / measured - 1 (%)")
    bx.legend(loc="lower left", fontsize=8)
    fig.suptitle("ring attention, zigzag, causal, fp32, 4 heads x 64, 2048 tokens a rank")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--ctxpar", default="build/ctxpar")
    ap.add_argument("--from", dest="from_json", help="plot saved runs instead of running")
    ap.add_argument("--ranks", default="2,4,8")
    ap.add_argument("--links", default="1,0.004", help="GB/s: compute- and transfer-dominated")
    ap.add_argument("--block", type=int, default=1024, help="tokens per rank")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json-out", default="docs/plan_local.json")
    ap.add_argument("--plot", default="docs/plan_vs_measured.png")
    a = ap.parse_args()
    if a.from_json:
        rows = json.load(open(a.from_json))
    else:
        rows = []
        for link in [float(x) for x in a.links.split(",")]:
            for p in [int(x) for x in a.ranks.split(",")]:
                r = one_case(a.ctxpar, p, link, a.block, a.heads, a.head_dim, a.repeats)
                print(json.dumps(r), file=sys.stderr)
                rows.append(r)
        with open(a.json_out, "w") as f:
            json.dump(rows, f, indent=1)
    print(table(rows))
    worst = max(abs(r["predicted_total"] / r["measured_total"] - 1) for r in rows)
    print(f"\nworst |predicted / measured - 1| = {100 * worst:.1f}%")
    plot(rows, a.plot)


if __name__ == "__main__":
    main()

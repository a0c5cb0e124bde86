#!/usr/bin/python3
"""Plots of a `ctxpar bench cp` sweep (DIR/results.json) as PNGs. See docs/cli-files.md.

    /usr/bin/python3 scripts/plot_cp.py DIR/results.json [--out DIR]

Writes, each only when the sweep has the data for it:
  throughput.png   attention GFLOP/s vs sequence length, a line per strategy, a panel per P
  memory.png       per-rank peak memory vs sequence length, a line per P, against what one
                   rank would need alone and against the ideal T/P scaling
  work.png         per-rank work (FLOPs) as bars, a bar per layout: the load balance
  time_split.png   each run's mean rank time split into compute, exposed communication, idle

Exit status: 0 written, 2 bad input, 3 matplotlib is missing (ctxpar prints the hint).
"""
import argparse
import json
import math
import os
import sys

try:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt
except ImportError:
    print("plot_cp.py: matplotlib is not installed (apt-get install python3-matplotlib)",
          file=sys.stderr)
    sys.exit(3)

STRATEGY_COLORS = {"ring": "#1f77b4", "allgather": "#d62728", "ulysses": "#2ca02c",
                   "hybrid": "#9467bd"}
LAYOUT_STYLES = {"contiguous": ("-", "o"), "zigzag": ("--", "s"), "striped": (":", "^")}
LAYOUT_COLORS = {"contiguous": "#ff7f0e", "zigzag": "#1f77b4", "striped": "#2ca02c"}
PART_COLORS = {"compute": "#4c72b0", "exposed communication": "#dd8452", "idle": "#c8c8c8"}


def tokens_label(t):
    t = int(t)
    if t >= 1 << 20 and t % (1 << 20) == 0:
        return "%dM" % (t >> 20)
    if t >= 1024 and t % 1024 == 0:
        return "%dK" % (t >> 10)
    return str(t)


def bytes_label(b):
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= size:
            return "%.3g %s" % (b / size, unit)
    return "%d B" % b


def per_rank(run, key):
    return [float(r.get(key, 0) or 0) for r in run.get("ranks", [])]


def rank_memory(run):
    """Largest rank's own shards plus the strategy's buffers at their peak."""
    ranks = run.get("ranks", [])
    if not ranks:
        return 0.0
    return max(float(r.get("peak_bytes", 0)) + float(r.get("shard_bytes", 0)) for r in ranks)


def seq_axis(ax, seqs):
    ax.set_xscale("log", base=2)
    ax.set_xticks(seqs)
    ax.set_xticklabels([tokens_label(s) for s in seqs])
    ax.minorticks_off()
    ax.set_xlabel("sequence length T (tokens)")
    ax.grid(True, which="major", alpha=0.3)


def subtitle(runs):
    r = runs[0]
    parts = ["mask %s" % r.get("mask", "?"), "B=%s" % r.get("batch", "?"),
             "H=%s" % r.get("heads", "?"), "D=%s" % r.get("head_dim", "?"),
             str(r.get("dtype", "")), "%s thread(s)/rank" % r.get("threads", "?")]
    if r.get("link_gbps"):
        parts.append("link %s GB/s" % r["link_gbps"])
    return ", ".join(parts)


def panels(n, width=5.0, height=3.8, max_cols=3):
    cols = min(n, max_cols)
    rows = math.ceil(n / cols)
    # At least 8 inches wide, so the two-line title and the legend row fit one panel too.
    fig, axes = plt.subplots(rows, cols, figsize=(max(width * cols, 8.0), height * rows + 0.8),
                             squeeze=False)
    flat = [a for row in axes for a in row]
    for a in flat[n:]:
        a.set_visible(False)
    return fig, flat[:n]


def figure_legend(fig, handles):
    """One legend below the panels, as many entries a row as fit (about 1.3 inch each)."""
    ncol = max(1, min(len(handles), int(fig.get_figwidth() / 1.3)))
    fig.legend(handles=handles, loc="lower center", fontsize=9, frameon=False, ncol=ncol)
    fig.legend_rows = math.ceil(len(handles) / ncol)  # read by save() to leave room


def save(fig, out_dir, name, title, runs):
    fig.suptitle(title + "\n" + subtitle(runs), fontsize=11)
    # Leave room at the bottom for the figure-level legend: about 0.3 inch a row.
    rows = getattr(fig, "legend_rows", 0)
    bottom = (0.15 + 0.3 * rows) / fig.get_figheight() if rows else 0.0
    fig.tight_layout(rect=(0, bottom, 1, 1))
    path = os.path.join(out_dir, name)
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=100)
    os.replace(tmp, path)  # complete or absent, like the results files
    plt.close(fig)
    print("wrote", path)


def plot_throughput(runs, out_dir):
    phases = [("forward", "forward_gflops_per_second")]
    if any(r.get("backward") for r in runs):
        phases.append(("backward", "backward_gflops_per_second"))
    ranks = sorted({r["num_ranks"] for r in runs})
    shown = [p for p in ranks if p > 1] or ranks
    seqs = sorted({r["seq"] for r in runs})
    fig, axes = panels(len(shown) * len(phases), max_cols=max(len(shown), 1))
    for pi, (phase, key) in enumerate(phases):
        # P = 1 is the reference every panel compares with: the best single-rank strategy.
        single = {}
        for r in runs:
            if r["num_ranks"] == 1:
                single[r["seq"]] = max(single.get(r["seq"], 0), float(r.get(key, 0)))
        for i, p in enumerate(shown):
            ax = axes[pi * len(shown) + i]
            for s in sorted({r["strategy"] for r in runs if r["num_ranks"] == p}):
                for lay in sorted({r["layout"] for r in runs if r["num_ranks"] == p}):
                    pts = sorted((r["seq"], float(r.get(key, 0))) for r in runs
                                 if r["num_ranks"] == p and r["strategy"] == s and r["layout"] == lay)
                    if not pts:
                        continue
                    ls, mk = LAYOUT_STYLES.get(lay, ("-", "o"))
                    ax.plot([x for x, _ in pts], [y for _, y in pts], ls, marker=mk,
                            color=STRATEGY_COLORS.get(s, None), label="%s / %s" % (s, lay))
            if p > 1 and single:
                xs = sorted(single)
                ax.plot(xs, [single[x] for x in xs], color="black", lw=1, ls="-.", alpha=0.6,
                        label="1 rank (best)")
            seq_axis(ax, seqs)
            ax.set_ylim(bottom=0)
            ax.set_ylabel("%s GFLOP/s (all ranks)" % phase)
            ax.set_title("%s, P = %d rank%s" % (phase, p, "s" if p > 1 else ""), fontsize=10)
    # One legend for the figure: colour = strategy, line style = layout.
    strategies = sorted({r["strategy"] for r in runs})
    layouts = [lay for lay in LAYOUT_STYLES if any(r["layout"] == lay for r in runs)]
    handles = [plt.Line2D([], [], color=STRATEGY_COLORS.get(s), lw=3, label=s) for s in strategies]
    handles += [plt.Line2D([], [], color="grey", ls=LAYOUT_STYLES[lay][0],
                           marker=LAYOUT_STYLES[lay][1], label=lay) for lay in layouts]
    if single and any(p > 1 for p in shown):
        handles.append(plt.Line2D([], [], color="black", ls="-.", alpha=0.6, label="1 rank (best)"))
    figure_legend(fig, handles)
    save(fig, out_dir, "throughput.png",
         "Attention throughput vs sequence length (FLOPs actually computed / slowest rank's time)",
         runs)


def plot_memory(runs, out_dir):
    strategies = sorted({r["strategy"] for r in runs})
    ranks = sorted({r["num_ranks"] for r in runs})
    seqs = sorted({r["seq"] for r in runs})
    cmap = plt.get_cmap("viridis")
    fig, axes = panels(len(strategies))
    for ax, s in zip(axes, strategies):
        for i, p in enumerate(ranks):
            mem = {}
            for r in runs:
                if r["strategy"] == s and r["num_ranks"] == p:
                    mem[r["seq"]] = max(mem.get(r["seq"], 0), rank_memory(r))  # worst layout
            if not mem:
                continue
            color = cmap(i / max(len(ranks) - 1, 1) * 0.85)
            xs = sorted(mem)
            ax.plot(xs, [mem[x] for x in xs], "-o", color=color, label="P = %d, measured" % p)
            # The ideal: one rank's memory divided by P (memory per rank ~ T / P).
            one = {r["seq"]: float(r.get("single_rank_bytes", 0)) for r in runs}
            if p > 1:
                ax.plot(xs, [one[x] / p for x in xs], ":", color=color, lw=1)
        one = {r["seq"]: float(r.get("single_rank_bytes", 0)) for r in runs}
        xs = sorted(one)
        ax.plot(xs, [one[x] for x in xs], "k--", lw=1.5, label="one rank alone")
        ax.plot([], [], "k:", lw=1, label="ideal: one rank / P")
        seq_axis(ax, seqs)
        ax.set_yscale("log", base=2)
        lo, hi = ax.get_ylim()
        ticks = [2 ** k for k in range(int(math.floor(math.log2(lo))), int(math.ceil(math.log2(hi))) + 1)]
        step = max(1, len(ticks) // 6)
        ax.set_yticks(ticks[::step])
        ax.set_yticklabels([bytes_label(t) for t in ticks[::step]])
        ax.minorticks_off()
        ax.set_ylabel("peak memory per rank")
        ax.set_title(s, fontsize=10)
        ax.legend(fontsize=7)
    save(fig, out_dir, "memory.png",
         "Per-rank peak memory (own shards + strategy buffers, worst rank) vs sequence length",
         runs)


def plot_work(runs, out_dir):
    seq = max(r["seq"] for r in runs)
    p = max(r["num_ranks"] for r in runs if r["seq"] == seq)
    sel = [r for r in runs if r["seq"] == seq and r["num_ranks"] == p]
    strategies = sorted({r["strategy"] for r in sel})
    layouts = [lay for lay in ("contiguous", "zigzag", "striped") if any(r["layout"] == lay for r in sel)]
    width = min(max(5.0, 0.3 * p * len(layouts) + 2), 9.0)
    fig, axes = panels(len(strategies), width=width, max_cols=3 if width <= 6 else 2)
    for ax, s in zip(axes, strategies):
        width = 0.8 / max(len(layouts), 1)
        balance = []
        for li, lay in enumerate(layouts):
            run = next((r for r in sel if r["strategy"] == s and r["layout"] == lay), None)
            if run is None:
                continue
            work = per_rank(run, "attention_flops")
            mean = sum(work) / len(work) if work else 0
            xs = [rk + (li - (len(layouts) - 1) / 2) * width for rk in range(len(work))]
            ax.bar(xs, [w / 1e9 for w in work], width, color=LAYOUT_COLORS.get(lay))
            balance.append("%s %.2f" % (lay, max(work) / mean if mean else 1.0))
        ax.set_xticks(range(p))
        ax.set_xlabel("rank")
        ax.set_ylabel("attention GFLOP computed")
        ax.set_title("%s, T = %s, P = %d" % (s, tokens_label(seq), p), fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
        # Headroom above the tallest bar for the max/mean box, so it never hides a bar.
        ax.set_ylim(0, ax.get_ylim()[1] * (1.1 + 0.1 * len(balance)))
        ax.text(0.02, 0.97, "max / mean work:\n" + "\n".join(balance), transform=ax.transAxes,
                va="top", ha="left", fontsize=8,
                bbox=dict(boxstyle="round", facecolor="white", alpha=0.9, edgecolor="#bbbbbb"))
    handles = [plt.Rectangle((0, 0), 1, 1, color=LAYOUT_COLORS.get(lay), label=lay) for lay in layouts]
    figure_legend(fig, handles)
    save(fig, out_dir, "work.png", "Per-rank work: load balance by layout", runs)


def plot_time_split(runs, out_dir):
    seq = max(r["seq"] for r in runs)
    sel = [r for r in runs if r["seq"] == seq]
    ranks = sorted({r["num_ranks"] for r in sel})
    fig, axes = panels(len(ranks), width=5.5, max_cols=2)
    longest = max(max(per_rank(r, "wall_seconds") or [0]) for r in sel)
    unit, scale = ("s", 1.0) if longest >= 10 else ("ms", 1e3)
    for ax, p in zip(axes, ranks):
        rows = sorted((r for r in sel if r["num_ranks"] == p),
                      key=lambda r: (r["strategy"], r["layout"]))
        labels, parts = [], {k: [] for k in PART_COLORS}
        for r in rows:
            n = max(len(r.get("ranks", [])), 1)
            wall = sum(per_rank(r, "wall_seconds")) / n
            busy = sum(per_rank(r, "busy_seconds")) / n
            wait = sum(per_rank(r, "comm_wait_seconds")) / n
            labels.append("%s\n%s" % (r["strategy"], r["layout"]))
            parts["compute"].append(busy * scale)
            parts["exposed communication"].append(wait * scale)
            parts["idle"].append(max(wall - busy - wait, 0.0) * scale)
        left = [0.0] * len(rows)
        ys = list(range(len(rows)))
        for name, color in PART_COLORS.items():
            ax.barh(ys, parts[name], left=left, color=color, label=name)
            left = [a + b for a, b in zip(left, parts[name])]
        ax.set_yticks(ys)
        ax.set_yticklabels(labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("mean time per rank (%s)" % unit)
        ax.set_title("T = %s, P = %d" % (tokens_label(seq), p), fontsize=10)
        ax.grid(True, axis="x", alpha=0.3)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c, label=n) for n, c in PART_COLORS.items()]
    figure_legend(fig, handles)
    save(fig, out_dir, "time_split.png",
         "Where the time goes: compute, exposed (waited-for) communication, idle", runs)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", help="results.json of ctxpar bench cp")
    ap.add_argument("--out", help="directory for the PNGs (default: beside results.json)")
    args = ap.parse_args()
    try:
        with open(args.results) as f:
            data = json.load(f)
        runs = [r for r in data["runs"] if r.get("ranks")]
    except (OSError, ValueError, KeyError, TypeError) as e:
        print("plot_cp.py: %s: %s" % (args.results, e), file=sys.stderr)
        return 2
    out_dir = args.out or os.path.dirname(os.path.abspath(args.results))
    if not runs:
        print("plot_cp.py: %s has no finished runs; nothing to plot" % args.results, file=sys.stderr)
        return 0
    plot_throughput(runs, out_dir)
    plot_memory(runs, out_dir)
    plot_work(runs, out_dir)
    plot_time_split(runs, out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())

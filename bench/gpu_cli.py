#!/usr/bin/env python3
"""The GPU check's runs of the `ctxpar` command (scripts/gpu_check.sh; docs/cuda.md). Never run
on a GPU yet. Standard library only.

  gpu_cli.py grid     CTXPAR OUT.json BUDGET_S  correctness grid on the loopback transport:
                      strategy x layout x mask x P in {1,2,4,8}, fp32 and bf16, forward and
                      backward, small T, each run --check'ed against the fp64 CPU reference;
                      then per (strategy, layout, mask, dtype, quantity) the error must not grow
                      with P: err(P) <= 2 err(1) + tolerance/10.
  gpu_cli.py scaling  CTXPAR OUT.json BUDGET_S  P = 1, 4, 8 loopback ranks on one GPU, bf16
                      causal (goal: P ranks within 1.10x of one rank's time).
  gpu_cli.py longest  CTXPAR OUT.json BUDGET_S  the longest causal sequence the loopback ring
                      runs on this GPU: T doubles from 64K until a run fails (out of memory).
Exit status: 0 when every run that ran passed, 1 otherwise; runs left when the budget is
spent are recorded as not run.
"""
import concurrent.futures as cf
import itertools
import json
import subprocess
import sys
import time

STRATEGIES = ["ring", "allgather", "ulysses", "hybrid"]
LAYOUTS = ["zigzag", "contiguous", "striped"]
MASKS = ["none", "causal", "causal+window:32,0", "documents:100,156"]
RANKS = [1, 2, 4, 8]
DTYPES = ["fp32", "bf16"]


def run(ctxpar, args, timeout):
    cmd = [ctxpar, "attention", "--device", "cuda", "--transport", "loopback", "--json"] + args
    t0 = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"cmd": " ".join(cmd), "rc": "timeout", "seconds": timeout}
    r = {"cmd": " ".join(cmd), "rc": p.returncode, "seconds": round(time.time() - t0, 3)}
    try:
        r["json"] = json.loads(p.stdout)
    except ValueError:
        r["stderr"] = p.stderr.strip()[-2000:]
    return r


def grid(ctxpar, budget):
    deadline = time.time() + budget
    cases = list(itertools.product(STRATEGIES, LAYOUTS, MASKS, DTYPES, RANKS))

    def one(case):
        s, l, m, d, p = case
        if time.time() > deadline:
            return case, {"rc": "not run (budget spent)"}
        args = ["--seq", "256", "--heads", "8", "--kv-heads", "2", "--head-dim", "32",
                "--strategy", s, "--layout", l, "--mask", m, "--dtype", d, "--ranks", str(p),
                "--backward", "--check"]
        if s == "hybrid" and p > 1:
            args += ["--ulysses-degree", "2"]
        return case, run(ctxpar, args, 60)

    with cf.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, cases))
    runs, ok = [], True
    errs = {}
    for (s, l, m, d, p), r in results:
        j = r.pop("json", None)
        row = {"strategy": s, "layout": l, "mask": m, "dtype": d, "ranks": p, **r}
        if j:
            row["check_passed"] = j.get("check_passed")
            for q in j.get("check", {}).get("quantities", []):
                row[q["name"] + "_err"] = q["max_abs_err"]
                row[q["name"] + "_tol"] = q["tolerance"]
                errs.setdefault((s, l, m, d, q["name"]), {})[p] = (q["max_abs_err"], q["tolerance"])
        ok &= row.get("check_passed") is True or row["rc"] == "not run (budget spent)"
        runs.append(row)
    growth = []
    for key, by_p in sorted(errs.items()):
        if 1 not in by_p:
            continue
        e1, tol = by_p[1]
        for p, (e, _) in sorted(by_p.items()):
            if e > 2 * e1 + tol / 10:
                growth.append({"case": list(key), "ranks": p, "err": e, "err_p1": e1})
    ok &= not growth
    return {"runs": runs, "error_grows_with_p": growth, "passed": ok}


def scaling(ctxpar, budget):
    deadline = time.time() + budget
    out = []
    for t in ["32K", "128K"]:
        for p in [1, 4, 8]:
            if time.time() > deadline:
                out.append({"seq": t, "ranks": p, "rc": "not run (budget spent)"})
                continue
            r = run(ctxpar, ["--seq", t, "--heads", "32", "--kv-heads", "8", "--head-dim", "128",
                             "--dtype", "bf16", "--mask", "causal", "--ranks", str(p),
                             "--repeats", "3"], 120)
            j = r.pop("json", None) or {}
            out.append({"seq": t, "ranks": p, "forward_seconds": j.get("forward_seconds"), **r})
    for row in out:
        one = next((x for x in out if x["seq"] == row["seq"] and x["ranks"] == 1), None)
        if one and one.get("forward_seconds") and row.get("forward_seconds"):
            row["vs_one_rank"] = row["forward_seconds"] / one["forward_seconds"]
    return {"runs": out, "goal": "P ranks <= 1.10x one rank",
            "passed": all(r.get("rc") in (0, "not run (budget spent)") for r in out)}


def longest(ctxpar, budget):
    deadline = time.time() + budget
    t, last_ok, runs = 64 * 1024, None, []
    while time.time() < deadline:
        r = run(ctxpar, ["--seq", str(t), "--heads", "32", "--kv-heads", "8", "--head-dim", "128",
                         "--dtype", "bf16", "--mask", "causal", "--ranks", "8"],
                max(1, deadline - time.time()))
        j = r.pop("json", None) or {}
        runs.append({"seq": t, "forward_seconds": j.get("forward_seconds"), **r})
        if r["rc"] != 0:
            break
        last_ok, t = t, t * 2
    return {"runs": runs, "longest_causal_seq": last_ok, "ranks": 8, "passed": last_ok is not None}


def main():
    mode, ctxpar, out, budget = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
    result = {"grid": grid, "scaling": scaling, "longest": longest}[mode](ctxpar, budget)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"{mode}: {'passed' if result['passed'] else 'FAILED'} ({out})")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())

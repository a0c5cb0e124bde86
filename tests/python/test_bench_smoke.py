"""bench/python_sdpa.py runs (tiny problem) and prints both sides; its timings are not checked
(benchmarks are programs, not timed tests) and its errors only for sanity: the accuracy rule
itself is test_attention.py's."""
import json
import os
import subprocess
import sys

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench",
                     "python_sdpa.py")


def test_bench_prints_json_with_both_sides():
    run = subprocess.run([sys.executable, BENCH, "--seq", "64", "--heads", "2", "--head-dim", "16",
                          "--repeats", "1"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    for side in ("torch", "ctxpar"):
        assert result[side]["fwd_s"] > 0 and result[side]["fwd_bwd_s"] > 0
        # fp32 rounding is ~1e-6 here; a wrong mask or a dropped rank is O(1).
        assert result[side]["err_out"] < 1e-3 and result[side]["err_dq"] < 1e-3
    # torch < 2.5 has no context_parallel; a later one has it but needs a process group: either
    # way the JSON says why it did not run.
    assert result["torch_context_parallel"].startswith(("not run: torch", "available but not run"))

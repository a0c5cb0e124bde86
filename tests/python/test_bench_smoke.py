"""bench/python_sdpa.py runs (tiny problem) and prints both sides; its timings are not checked
(benchmarks are programs, not timed tests) and its errors only for sanity: the accuracy rule
itself is test_attention.py's."""
import json
import os
import subprocess
import sys

import pytest

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


def test_torch_sdpa_hands_torch_the_memory_asked_for():
    """bench/torch_sdpa.py with torch itself: --memory bhtd gives SDPA contiguous [B, H, T, D],
    --memory bthd the [B, H, T, D] transpose of [B, T, H, D] storage (a model's projections);
    both time torch's CPU flash kernel and say which memory they used."""
    torch_sdpa = os.path.join(os.path.dirname(BENCH), "torch_sdpa.py")
    h, t, d = 2, 64, 16
    for memory, stride in (("bhtd", [h * t * d, t * d, d, 1]), ("bthd", [t * h * d, d, h * d, 1])):
        run = subprocess.run([sys.executable, torch_sdpa, "--seq", str(t), "--heads", str(h),
                              "--head-dim", str(d), "--warmup-seq", "32", "--memory", memory],
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        result = json.loads(run.stdout)
        assert result["memory"] == memory and result["q_stride"] == stride, result
        assert result["fwd_gflops"] > 0 and result["causal_bwd_gflops"] > 0
        assert any("flash_attention" in k for k in result["backend"]), result["backend"]


REPORT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench",
                      "cpu_suite_report.py")


def _attention_json(threads, walls, cpus):
    """An attention --json run of len(walls) ranks: forward wall = the slowest rank's."""
    return {"threads": threads, "forward_seconds": max(walls),
            "ranks": [{"rank": i, "wall_seconds": w, "forward_cpu_seconds": c}
                      for i, (w, c) in enumerate(zip(walls, cpus))]}


def test_cpu_suite_report_prints_cpu_ratios_beside_wall(tmp_path):
    """On a shared machine the zigzag / contiguous wall ratio read 0.99 while CPU time
    read 1.40-1.44. The report gives the ring rows both: the slowest rank's wall and CPU seconds,
    per repetition, median over them; a rank with OpenMP workers has no CPU figure."""
    info, raw = tmp_path / "info", tmp_path / "raw"
    info.mkdir()
    runs = ["kernel_1t", "kernel_2t", "ring_p2_zigzag", "ring_p2_contiguous", "one_rank_2t"]
    shape = {"seq": 64, "heads": 1, "head_dim": 16}
    (info / "config.json").write_text(json.dumps(dict(
        repeats=2, inner=1, quick=True, torch_pin="2.15.0", torch_python="none",
        kernel_shape=shape, cp_shape=shape, ggml_binary=None, runs=runs)))
    (info / "lscpu.txt").write_text("Model name: Test CPU\nCPU(s): 2\nFlags: fma avx2\n")
    (info / "torch_skipped").write_text("--no-torch given")
    kernel = {"fwd_peak_ratio": 0.8, "bwd_peak_ratio": 0.7}
    # Per repetition: contiguous wall 1.0 (the machine was shared), CPU 1.5 / 2.8 on its
    # busiest rank; zigzag wall 1.0 / 1.01, CPU 1.0 / 2.0.
    reps = [((1.0, 0.6), (0.5, 1.5), (1.0, 0.9), (1.0, 1.0)),
            ((1.0, 1.0), (1.2, 2.8), (1.01, 1.0), (2.0, 1.9))]
    for i, (cw, cc, zw, zc) in enumerate(reps):
        d = raw / f"rep{i + 1}"
        d.mkdir(parents=True)
        for name, body in (("kernel_1t", kernel), ("kernel_2t", kernel),
                           ("ring_p2_contiguous", _attention_json(1, cw, cc)),
                           ("ring_p2_zigzag", _attention_json(1, zw, zc)),
                           ("one_rank_2t", _attention_json(2, (1.5,), (0.8,)))):
            (d / f"{name}.json").write_text(json.dumps(body))
    run = subprocess.run([sys.executable, REPORT, str(tmp_path)], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    fig = json.loads((tmp_path / "summary.json").read_text())["figures"]
    zc = fig["zigzag_vs_contiguous"]
    assert zc["values"] == [1.0, 1.0 / 1.01]
    assert zc["cpu"]["values"] == [1.5 / 1.0, 2.8 / 2.0]
    assert abs(zc["cpu"]["median"] - (1.5 + 1.4) / 2) < 1e-12
    assert fig["ring_p2_zigzag_vs_one_rank_2t"]["cpu"]["values"] == []  # 2-thread rank: none
    row = next(l for l in run.stdout.splitlines() if l.startswith("zigzag / contiguous"))
    assert "0.995" in row and "1.450" in row and "1.400 - 1.500" in row, row
    row = next(l for l in run.stdout.splitlines() if l.startswith("ring P=2 zigzag"))
    assert "n/a" in row and "(rank threads)" in row, row


def _kernel_suite(tmp_path, runs, seconds, flags):
    """A suite directory of one repetition: `runs`, each kernel-like run's four passes taking
    seconds[name]; the report run over it; its figures and stdout."""
    info, raw = tmp_path / "info", tmp_path / "raw"
    info.mkdir()
    shape = {"seq": 64, "heads": 1, "head_dim": 16}
    (info / "config.json").write_text(json.dumps(dict(
        repeats=1, inner=1, quick=True, torch_pin="2.15.0", torch_python="x",
        kernel_shape=shape, cp_shape=shape, ggml_binary=None, runs=runs)))
    (info / "lscpu.txt").write_text(f"Model name: Test CPU\nCPU(s): 2\nFlags: {flags}\n")
    (info / "torch.json").write_text(json.dumps(
        {"torch_version": "2.15.0", "cpu_capability": "AVX512", "python": "3.11"}))
    d = raw / "rep1"
    d.mkdir(parents=True)
    for name, s in seconds.items():
        body = {k + "_seconds": s for k in ("fwd", "bwd", "causal_fwd", "causal_bwd")}
        # GFLOP/s of 100 GFLOP a pass (causal: half), as bench kernel and torch_sdpa.py count.
        body.update({k + "_gflops": (50.0 if k.startswith("causal") else 100.0) / s
                     for k in ("fwd", "bwd", "causal_fwd", "causal_bwd")})
        body.update(fwd_peak_ratio=0.8, bwd_peak_ratio=0.7, peak_gflops=200.0)
        if name.startswith("torch"):  # cpu_suite.sh's FMA peaks right before and after it
            body.update(peak_gflops_before=180.0, peak_gflops_after=200.0)
        (d / f"{name}.json").write_text(json.dumps(body))
    run = subprocess.run([sys.executable, REPORT, str(tmp_path)], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    return json.loads((tmp_path / "summary.json").read_text())["figures"], run.stdout


def test_cpu_suite_report_has_both_bf16_product_kinds_and_tiers(tmp_path):
    """On an AVX512_BF16 CPU (Zen 5's rows are the goal) the suite runs vdpbf16ps in
    both tiers beside fp32 products forced, and on an AMX CPU the tiles too; the report's ratios
    are fp32-products seconds over each run's, and torch's bf16 seconds over each run's (goal
    1.5), per repetition."""
    runs = ["kernel_1t", "kernel_bf16dot_1t", "kernel_bf16dotfast_1t", "kernel_bf16fp32_1t",
            "kernel_bf16amx_1t", "kernel_bf16amxfast_1t", "torch_bf16_1t"]
    seconds = {"kernel_bf16fp32_1t": 6.0, "kernel_bf16dot_1t": 4.0, "kernel_bf16dotfast_1t": 3.0,
               "kernel_bf16amx_1t": 5.0, "kernel_bf16amxfast_1t": 2.0, "torch_bf16_1t": 4.5,
               "kernel_1t": 6.0}
    fig, _ = _kernel_suite(tmp_path, runs, seconds, "avx512f avx512_bf16")
    for products, exact, fast in (("dot", 4.0, 3.0), ("amx", 5.0, 2.0)):
        for pas in ("fwd", "bwd", "causal_fwd", "causal_bwd"):
            assert fig[f"bf16{products}_vs_fp32_products_{pas}"]["values"] == [6.0 / exact]
            assert fig[f"bf16{products}_vs_fp32_products_{pas}"]["goal"] == 1.3
            assert fig[f"bf16{products}fast_vs_fp32_products_{pas}"]["values"] == [6.0 / fast]
        for pas in ("fwd", "bwd"):
            assert fig[f"bf16{products}_vs_torch_bf16_{pas}"]["values"] == [4.5 / exact]
            assert fig[f"bf16{products}fast_vs_torch_bf16_{pas}"]["values"] == [4.5 / fast]
            assert fig[f"bf16{products}fast_vs_torch_bf16_{pas}"]["goal"] == 1.5
        # Issue 40: the exact tier's backward at torch's speed; its forward has no goal.
        assert fig[f"bf16{products}_vs_torch_bf16_bwd"]["goal"] == 1.0
        assert fig[f"bf16{products}_vs_torch_bf16_fwd"]["goal"] is None


def test_cpu_suite_report_has_the_fp32_parts_rows(tmp_path):
    """On an AMX CPU the suite runs fp32 through three bf16 parts (CTXPAR_FP32_PRODUCTS=parts)
    at 1 and 2 threads; the report's ratios are fp32 FMAs' seconds and torch's fp32 seconds
    (goal 1.2) over each parts run's, per repetition."""
    runs = ["kernel_1t", "kernel_2t", "torch_1t", "torch_2t", "kernel_fp32parts_1t",
            "kernel_fp32parts_2t"]
    seconds = {"kernel_1t": 6.0, "kernel_2t": 3.0, "torch_1t": 6.6, "torch_2t": 3.5,
               "kernel_fp32parts_1t": 4.0, "kernel_fp32parts_2t": 2.5}
    fig, out = _kernel_suite(tmp_path, runs, seconds, "avx512f amx_bf16")
    for n, fma, torch, parts in ((1, 6.0, 6.6, 4.0), (2, 3.0, 3.5, 2.5)):
        for pas in ("fwd", "bwd", "causal_fwd", "causal_bwd"):
            assert fig[f"fp32parts_vs_fma_{pas}_{n}t"]["values"] == [fma / parts]
            assert fig[f"fp32parts_vs_torch_{pas}_{n}t"]["values"] == [torch / parts]
            assert fig[f"fp32parts_vs_torch_{pas}_{n}t"]["goal"] == 1.2
    assert "fp32 parts (AMX) / torch SDPA speed, forward, non-causal, 1 thread" in out
    # Issue 40's kernel goal, and the peak's range over the repetitions (here one).
    assert fig["kernel_fwd_peak_1t"]["goal"] == fig["kernel_bwd_peak_1t"]["goal"] == 0.80
    assert fig["kernel_fwd_peak_1t"]["median_meets_goal"]
    assert not fig["kernel_bwd_peak_1t"]["median_meets_goal"]  # 0.7
    assert "one-thread FMA peak over the repetitions: 200 - 200 GFLOP/s" in out


def test_cpu_suite_report_sets_ctxpar_beside_torch_on_the_same_memory(tmp_path):
    """torch_bthd_*: torch's SDPA on [B, T, H, D] storage (a model's transposed projections), the
    memory ctxpar's kernel reads; the report's same-memory ratios are those runs' seconds over
    ctxpar's (fp32 at 1 and 2 threads, bf16 default and both AMX tiers), with no goal, and the
    goal rows keep torch's own-layout runs."""
    runs = ["kernel_1t", "kernel_2t", "torch_1t", "torch_2t", "kernel_bf16_1t", "torch_bf16_1t",
            "kernel_bf16_2t", "torch_bf16_2t", "torch_bthd_1t", "torch_bthd_2t",
            "torch_bthd_bf16_1t", "kernel_bf16amx_1t", "kernel_bf16amxfast_1t", "kernel_bf16fp32_1t"]
    seconds = {"kernel_1t": 6.0, "kernel_2t": 3.0, "torch_1t": 6.6, "torch_2t": 3.5,
               "kernel_bf16_1t": 2.0, "torch_bf16_1t": 3.0, "kernel_bf16_2t": 1.0,
               "torch_bf16_2t": 1.6, "torch_bthd_1t": 7.2, "torch_bthd_2t": 3.9,
               "torch_bthd_bf16_1t": 3.3, "kernel_bf16amx_1t": 2.2, "kernel_bf16amxfast_1t": 1.5,
               "kernel_bf16fp32_1t": 4.0}
    fig, out = _kernel_suite(tmp_path, runs, seconds, "avx512f amx_bf16")
    for pas in ("fwd", "bwd", "causal_fwd", "causal_bwd"):
        assert fig[f"vs_torch_bthd_{pas}_1t"]["values"] == [7.2 / 6.0]
        assert fig[f"vs_torch_bthd_{pas}_2t"]["values"] == [3.9 / 3.0]
        assert fig[f"vs_torch_bthd_{pas}_bf16_1t"]["values"] == [3.3 / 2.0]
        assert fig[f"vs_torch_bthd_{pas}_1t"]["goal"] is None
        assert fig[f"vs_torch_{pas}_1t"]["values"] == [6.6 / 6.0]  # the goal row: torch's layout
        assert fig[f"vs_torch_{pas}_1t"]["goal"] == 1.2
    for pas in ("fwd", "bwd"):
        assert fig[f"bf16amx_vs_torch_bthd_bf16_{pas}"]["values"] == [3.3 / 2.2]
        assert fig[f"bf16amxfast_vs_torch_bthd_bf16_{pas}"]["values"] == [3.3 / 1.5]
        assert fig[f"bf16amxfast_vs_torch_bthd_bf16_{pas}"]["goal"] is None
        assert fig[f"bf16amxfast_vs_torch_bf16_{pas}"]["values"] == [3.0 / 1.5]
    assert "ctxpar / torch SDPA speed, both on [B,T,H,D] memory, forward, non-causal, 1 thread" in out


def test_cpu_suite_report_says_what_the_fp32_goal_needs_of_the_fma_peak(tmp_path):
    """Issue 40 asks, where a CPU kind cannot reach 1.2 x torch in fp32, for why with a
    measurement: the report gives torch's fp32 GFLOP/s (against the FMA peak measured right
    before and after it) and ctxpar's causal ones (against its run's own) as shares of the FMA
    peak, per repetition, and under the table what the goal needs (1.2 x torch's median share)
    beside ctxpar's share; and every ctxpar / torch ratio again with each side divided by its
    own peak, so that the host's clock cancels."""
    runs = ["kernel_1t", "kernel_2t", "torch_1t", "torch_2t", "kernel_bf16_1t", "torch_bf16_1t",
            "kernel_bf16_2t", "torch_bf16_2t"]
    seconds = {"kernel_1t": 6.0, "kernel_2t": 3.0, "torch_1t": 6.6, "torch_2t": 3.5,
               "kernel_bf16_1t": 2.0, "torch_bf16_1t": 3.0, "kernel_bf16_2t": 1.0,
               "torch_bf16_2t": 1.6}
    fig, out = _kernel_suite(tmp_path, runs, seconds, "avx512f")
    tp = (180.0 + 200.0) / 2  # torch's peak: the mean of before and after; ctxpar's run 200
    for n, torch, ours in ((1, 6.6, 6.0), (2, 3.5, 3.0)):
        for pas in ("fwd", "bwd"):
            assert fig[f"torch_{pas}_peak_{n}t"]["values"] == [100.0 / torch / tp]
            assert fig[f"torch_causal_{pas}_peak_{n}t"]["values"] == [50.0 / torch / tp]
            assert fig[f"kernel_causal_{pas}_peak_{n}t"]["values"] == [50.0 / ours / 200.0]
            assert fig[f"torch_{pas}_peak_{n}t"]["goal"] is None
            for prefix in ("", "causal_"):
                f = fig[f"vs_torch_at_peak_{prefix}{pas}_{n}t"]
                assert f["values"] == [pytest.approx(torch / ours * tp / 200.0)], f
                assert f["goal"] == 1.2
        b = fig[f"vs_torch_at_peak_bf16_fwd_{n}t"]
        assert b["values"] == [pytest.approx(seconds[f"torch_bf16_{n}t"] /
                                             seconds[f"kernel_bf16_{n}t"] * tp / 200.0)]
        assert b["goal"] is None
    needs = json.loads((tmp_path / "summary.json").read_text())["fp32_goal_needs"]
    assert needs["1"]["forward"] == {"needs": 1.2 * (100.0 / 6.6 / tp), "ctxpar": 0.8}
    assert needs["2"]["causal backward"] == {"needs": 1.2 * (50.0 / 3.5 / tp),
                                             "ctxpar": 50.0 / 3.0 / 200.0}
    assert "torch SDPA fp32 forward, non-causal / one-thread FMA peak" in out
    assert "ctxpar / torch SDPA, each / its FMA peak, forward, non-causal, 1 thread" in out
    line = next(l for l in out.splitlines() if l.startswith("  1 thread:"))
    assert f"forward {1.2 * 100.0 / 6.6 / tp:.2f} (0.80)" in line, line


def test_cpu_suite_report_has_no_peak_figures_for_torch_runs_without_peaks(tmp_path):
    """A torch run without the peaks beside it (a suite from before they were measured) gives
    those rows no figure rather than one against another run's peak."""
    runs = ["kernel_1t", "torch_1t"]
    fig, out = _kernel_suite(tmp_path, runs, {"kernel_1t": 6.0, "torch_1t": 6.6}, "avx512f")
    d = tmp_path / "raw" / "rep1" / "torch_1t.json"
    body = json.loads(d.read_text())
    del body["peak_gflops_before"], body["peak_gflops_after"]
    d.write_text(json.dumps(body))
    run = subprocess.run([sys.executable, REPORT, str(tmp_path)], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    fig = json.loads((tmp_path / "summary.json").read_text())["figures"]
    assert fig["vs_torch_at_peak_fwd_1t"]["values"] == []
    assert fig["torch_fwd_peak_1t"]["values"] == []
    assert fig["vs_torch_fwd_1t"]["values"] == [6.6 / 6.0]

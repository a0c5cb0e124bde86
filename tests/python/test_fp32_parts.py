"""CTXPAR_FP32_PRODUCTS=parts (docs/kernel.md, "fp32 products"): the Python package installs the
kernel's environment at import, so fp32 attention through a strategy takes AMX tiles on three
bf16 parts where this CPU has them (forward and backward against fp64 by the project's rule)
and is refused, naming the setting, where it does not. A fresh process each: the kernel's
environment is read once."""
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

SCRIPT = r"""
import sys
sys.path.insert(0, sys.argv[1])
import ctxpar
from conftest import check_close, problem, reference, visible
T = 160  # three key tiles, the last ragged
q, k, v, dout = problem(T=T, D=64)
ok = visible(T, "causal")
ref, naive = reference(q, k, v, dout, ok), reference(q, k, v, dout, ok, dtype=__import__("torch").float32)
out, lse = ctxpar.attention(q, k, v, ranks=2, strategy="ring", layout="zigzag", mask="causal")
grads = ctxpar.attention_backward(q, k, v, out, lse, dout, ranks=2, strategy="ring",
                                  layout="zigzag", mask="causal")
for name, ours, r, n in zip(["out", "lse", "dq", "dk", "dv"], [out, lse, *grads], ref, naive):
    check_close(name, ours, r, n)
print("parts ok")
"""


def amx_cpu():
    with open("/proc/cpuinfo") as f:
        flags = next((l for l in f if l.startswith("flags")), "").split()
    return "amx_bf16" in flags and "avx512f" in flags


def test_fp32_parts_from_the_environment():
    env = dict(os.environ, CTXPAR_FP32_PRODUCTS="parts")
    env.pop("CTXPAR_SIMD", None)
    run = subprocess.run([sys.executable, "-c", SCRIPT, HERE], capture_output=True, text=True,
                         env=env, timeout=300)
    if amx_cpu():
        assert run.returncode == 0 and "parts ok" in run.stdout, run.stdout + run.stderr
    else:
        assert run.returncode != 0, run.stdout
        assert "fp32_products = parts needs" in run.stderr, run.stderr


def test_a_bad_value_is_named():
    env = dict(os.environ, CTXPAR_FP32_PRODUCTS="fast")
    run = subprocess.run([sys.executable, "-c", SCRIPT, HERE], capture_output=True, text=True,
                         env=env, timeout=300)
    assert run.returncode != 0, run.stdout
    assert "CTXPAR_FP32_PRODUCTS=fast: expected fma" in run.stderr, run.stderr

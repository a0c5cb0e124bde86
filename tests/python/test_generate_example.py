"""examples/python/generate.py: greedy generation with the KV cache spread over 2 ranks gives
the tokens of one rank holding the whole cache (the example exits 1 when they differ; here
the printed lists are compared too), under mpirun, torchrun (gloo) and threads."""
import os
import re
import subprocess
import sys

import pytest

import ctxpar
from conftest import MPIRUN, TORCHRUN, mpirun, torchrun

GENERATE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples",
                        "python", "generate.py")
SMALL = ["--prompts", "21,13", "--tokens", "6", "--layers", "1"]


def assert_same_tokens(run, ranks, transport):
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"ranks {ranks} ({transport})" in run.stdout, run.stdout
    for s in range(2):
        spread = re.search(rf"sequence {s} spread: (\[.*\])", run.stdout).group(1)
        whole = re.search(rf"sequence {s} whole:  (\[.*\])", run.stdout).group(1)
        assert spread == whole and len(eval(spread)) == 6, run.stdout
    assert "same tokens as one rank with the whole cache" in run.stdout


@pytest.mark.skipif(MPIRUN is None, reason="mpirun not found (apt install openmpi-bin)")
def test_generate_under_mpirun_2():
    assert_same_tokens(mpirun(2, GENERATE, *SMALL, "--mode", "pass-q", timeout=300), 2, "mpi")


@pytest.mark.skipif(TORCHRUN is None or not ctxpar._distributed.gloo_available(),
                    reason="needs the venv's torchrun and ctxpar's gloo transport")
def test_generate_under_torchrun_2():
    assert_same_tokens(torchrun(2, GENERATE, *SMALL, timeout=300), 2, "gloo")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_generate_on_three_threads(dtype):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, GENERATE, *SMALL, "--threads", "3", "--dtype", dtype],
                         env=env, capture_output=True, text=True, timeout=300)
    assert_same_tokens(run, 3, "threads")


def test_generate_exits_1_and_says_so_when_the_tokens_differ(monkeypatch, capsys):
    sys.path.insert(0, os.path.dirname(GENERATE))
    import generate as g
    real = g.generate

    def perturbed(comm, args, prompts):  # the spread run's last token changed
        out, memory = real(comm, args, prompts)
        if comm.size > 1:
            out[0][-1] = (out[0][-1] + 1) % args.vocab
        return out, memory

    monkeypatch.setattr(g, "generate", perturbed)
    monkeypatch.setattr(sys, "argv", ["generate.py", *SMALL, "--threads", "2"])
    with pytest.raises(SystemExit) as e:
        g.main()
    assert e.value.code == 1
    assert "DIFFERENT tokens from one rank with the whole cache" in capsys.readouterr().out

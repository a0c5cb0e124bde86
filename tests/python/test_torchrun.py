"""ctxpar inside torchrun jobs (the venv's torchrun, gloo, --standalone): ctxpar.init() joins
the job, Communicator.from_torch / from_mesh give the threads transport's answers bit for bit,
context_parallel takes a DeviceMesh and routes an SDPA bound before the block, and a rank that
raises ends the job within seconds (torchrun_case.py is the worker); under srun without MPI,
or torchrun's variables in part, ctxpar.init() refuses instead of a world of one."""
import os
import re
import subprocess
import sys
import time

import pytest
import torch

import ctxpar
from ctxpar import layout as cl
from ctxpar.torch import context_parallel
from conftest import TORCHRUN, torchrun
from test_torch import run_ranks
from torchrun_case import T, attention_on, problem

HERE = os.path.dirname(os.path.abspath(__file__))
CASE = os.path.join(HERE, "torchrun_case.py")
needs_torchrun = pytest.mark.skipif(TORCHRUN is None, reason="no torchrun beside the python")
needs_gloo = pytest.mark.skipif(not ctxpar._distributed.gloo_available(),
                                reason="ctxpar built without its gloo transport")


@needs_torchrun
@pytest.mark.parametrize("mode", ["init", "init_after_torch"])
def test_init_under_torchrun_joins_the_job_or_refuses_naming_it(mode):
    run = torchrun(2, CASE, mode, timeout=240)
    if ctxpar._distributed.gloo_available():
        assert run.returncode == 0, run.stdout + run.stderr
        for r in range(2):
            assert f"rank {r} of 2: gloo" in run.stdout
    else:  # never a world of one per process
        assert run.returncode != 0
        assert "refused: ctxpar.init: this ctxpar was built without its gloo transport" in \
            run.stdout and "torchrun (WORLD_SIZE=2)" in run.stdout, run.stdout


@needs_torchrun
@needs_gloo
@pytest.mark.parametrize("ranks", [2, 4])
def test_from_torch_and_split_equal_threads_bitwise(ranks, tmp_path):
    run = torchrun(ranks, CASE, "torch", str(tmp_path), timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    world = run_ranks(ranks, attention_on)
    pairs = run_ranks(2, attention_on)
    for r in range(ranks):
        got = torch.load(tmp_path / f"rank{r}.pt")
        for name, a, b in zip(["out", "dq", "dk", "dv"], got["world"], world[r]):
            assert torch.equal(a, b), f"rank {r} {name}: gloo differs from threads"
        for name, a, b in zip(["out", "dq", "dk", "dv"], got["pair"], pairs[r % 2]):
            assert torch.equal(a, b), f"rank {r} (pair) {name}: gloo differs from threads"


@needs_torchrun
@needs_gloo
def test_context_parallel_on_a_2x2_mesh_routes_a_bound_sdpa_like_threads(tmp_path):
    run = torchrun(4, CASE, "mesh", str(tmp_path), timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    from torch.nn.functional import scaled_dot_product_attention as sdpa
    q, k, v, _ = (torch.from_numpy(x).transpose(1, 2).contiguous() for x in problem(T=T))

    def rank(comm):
        bufs = [x.clone() for x in (q, k, v)]
        with context_parallel(comm, buffers=bufs, buffer_seq_dims=[2, 2, 2]):
            out = sdpa(*bufs, is_causal=True, enable_gqa=True)
        return cl.unshard(out.transpose(1, 2), comm, layout="zigzag", seq_dim=1)

    expected = run_ranks(2, rank)[0]
    for r in range(4):
        assert torch.equal(torch.load(tmp_path / f"mesh{r}.pt"), expected), f"rank {r}"


@needs_torchrun
@needs_gloo
def test_a_raising_rank_ends_the_torchrun_job_within_seconds_naming_it():
    # Rank 0 waits in cp_attention with the default 120 s timeout; rank 1 raises. The clock
    # starts when rank 1 raises (it prints the time) and stops when torchrun has ended.
    run = torchrun(2, CASE, "raise", timeout=200)
    ended = time.time()
    assert run.returncode != 0, run.stdout + run.stderr
    assert "RuntimeError: rank 1 gave up before attention" in run.stderr, run.stderr
    assert "ctxpar: rank 1 failed: RuntimeError" in run.stderr, run.stderr
    assert "attention returned" not in run.stdout
    raised = float(run.stdout.split("rank 1 raises at ")[1].split()[0])
    assert ended - raised < 10, f"{ended - raised:.1f} s after the raise"
    # torchrun's summary names rank 1, from the error file it wrote (rank 0, stopped by it,
    # fails later or is ended by torchrun): Note [The error file names the rank that failed
    # first]. Before, no error file, and the root cause was rank 0.
    root = run.stderr.split("Root Cause (first observed failure):")[1]
    assert re.search(r"rank\s*: 1 \(local_rank: 1\)", root), root
    assert "error_file: <N/A>" not in root and "RuntimeError: rank 1 gave up" in root, root


def init_with(env_vars):
    """ctxpar.init() in a fresh interpreter with the launcher variables env_vars (and none of
    torchrun's, srun's or mpirun's from this process)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
           and not k.startswith(("SLURM_", "OMPI_", "PMI", "PMIX"))}
    env.update(env_vars)
    code = ("import ctxpar\ntry:\n    c = ctxpar.init()\n    print('world', c.rank, c.size)\n"
            "except RuntimeError as e:\n    print('refused:', e)\n")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120)


def test_init_under_srun_without_mpi_refuses_naming_srun_and_the_fix():
    run = init_with({"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_ID": "0"})
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("refused: ctxpar.init: started by srun "
                                 "(SLURM_STEP_NUM_TASKS=4) without an MPI plugin"), run.stdout
    assert "srun --mpi=pmix" in run.stdout


def test_init_with_torchrun_rank_but_no_master_refuses_naming_the_variables():
    run = init_with({"RANK": "1", "WORLD_SIZE": "2"})
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("refused: ctxpar.init: started by torchrun "
                                 "(WORLD_SIZE=2), but MASTER_ADDR, MASTER_PORT are not set"), \
        run.stdout

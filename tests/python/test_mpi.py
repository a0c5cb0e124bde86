"""cp_attention across processes: mpirun -n 2 (ctxpar.init()) and -n 4
(Communicator.from_mpi4py), each checked against the fp64 reference (mpi_case.py)."""
import os
import time

import pytest

from conftest import MPIRUN, mpirun

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.skipif(MPIRUN is None, reason="mpirun not found (apt install openmpi-bin)")
@pytest.mark.parametrize("ranks, how", [(2, "init"), (4, "mpi4py")])
def test_cp_attention_under_mpirun(ranks, how):
    if how == "mpi4py":
        pytest.importorskip("mpi4py")
    run = mpirun(ranks, os.path.join(HERE, "mpi_case.py"), how)
    assert run.returncode == 0, run.stdout + run.stderr
    for r in range(ranks):
        assert f"rank {r} of {ranks}: ok" in run.stdout


@pytest.mark.skipif(MPIRUN is None, reason="mpirun not found (apt install openmpi-bin)")
def test_cp_attention_ranks_that_disagree_are_refused_under_mpirun():
    run = mpirun(2, os.path.join(HERE, "mpi_fail.py"), "disagree", timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    for r in range(2):
        assert (f"rank {r} refused: cp_attention: the ranks were called with different "
                "arguments: layout is zigzag on rank 0 but striped on rank 1") in run.stdout


@pytest.mark.skipif(MPIRUN is None, reason="mpirun not found (apt install openmpi-bin)")
def test_a_python_exception_on_one_rank_ends_the_job_at_once_naming_it():
    # Rank 0 keeps the default 120 s timeout: an end well before it is the abort's doing
    # (60 s leaves room for two interpreters importing torch on a loaded machine).
    start = time.monotonic()
    run = mpirun(2, os.path.join(HERE, "mpi_fail.py"), "raise", timeout=110)
    elapsed = time.monotonic() - start
    assert run.returncode != 0, run.stdout + run.stderr
    assert "RuntimeError: rank 1 gave up before attention" in run.stderr
    assert "ctxpar: rank 1 failed: RuntimeError" in run.stderr, run.stderr
    assert "attention returned" not in run.stdout
    assert elapsed < 60, f"{elapsed:.1f} s"


@pytest.mark.skipif(MPIRUN is None, reason="mpirun not found (apt install openmpi-bin)")
def test_init_timeout_s_bounds_a_wait_under_mpirun():
    start = time.monotonic()
    run = mpirun(2, os.path.join(HERE, "mpi_fail.py"), "timeout", timeout=110)
    elapsed = time.monotonic() - start
    assert run.returncode != 0, run.stdout + run.stderr
    assert "rank 0: timed out after 2 s" in run.stderr, run.stderr
    assert "ctxpar: rank 0 failed: Error" in run.stderr, run.stderr
    assert elapsed < 60, f"{elapsed:.1f} s"

"""cp_attention across processes: mpirun -n 2 (ctxpar.init()) and -n 4
(Communicator.from_mpi4py), each checked against the fp64 reference (mpi_case.py)."""
import os
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
MPIRUN = shutil.which("mpirun")


def mpirun(ranks, script, *args, timeout=180):
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMP_NUM_THREADS="1")
    cmd = [MPIRUN, "-n", str(ranks), "--oversubscribe", sys.executable, script, *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.skipif(MPIRUN is None, reason="mpirun not found (apt install openmpi-bin)")
@pytest.mark.parametrize("ranks, how", [(2, "init"), (4, "mpi4py")])
def test_cp_attention_under_mpirun(ranks, how):
    if how == "mpi4py":
        pytest.importorskip("mpi4py")
    run = mpirun(ranks, os.path.join(HERE, "mpi_case.py"), how)
    assert run.returncode == 0, run.stdout + run.stderr
    for r in range(ranks):
        assert f"rank {r} of {ranks}: ok" in run.stdout

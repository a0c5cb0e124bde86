"""cp_attention across processes: mpirun -n 2 (ctxpar.init()) and -n 4
(Communicator.from_mpi4py), each checked against the fp64 reference (mpi_case.py)."""
import os

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

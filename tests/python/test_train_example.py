"""examples/python/train_cp.py: 30 training steps on 4 MPI processes give the losses of 1,
step by step, within 1e-5 relative (fp32; only summation orders differ)."""
import json
import os

import pytest

from conftest import MPIRUN, mpirun

EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples",
                       "python", "train_cp.py")


@pytest.mark.skipif(MPIRUN is None, reason="mpirun not found (apt install openmpi-bin)")
def test_four_processes_train_like_one(tmp_path):
    losses = {}
    for ranks in (1, 4):
        path = tmp_path / f"losses{ranks}.json"
        run = mpirun(ranks, EXAMPLE, "--steps", "30", "--losses", str(path), timeout=300)
        assert run.returncode == 0, run.stdout + run.stderr
        result = json.loads(path.read_text())
        assert result["ranks"] == ranks
        losses[ranks] = result["losses"]
    assert len(losses[1]) == len(losses[4]) == 30
    for step, (one, four) in enumerate(zip(losses[1], losses[4])):
        assert abs(four - one) <= 1e-5 * abs(one), f"step {step}: {four} (4 ranks) vs {one}"
    assert losses[1][-1] < losses[1][0] - 0.3  # and it learns

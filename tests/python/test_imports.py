"""The package without MPI's Python side: `import ctxpar` with mpi4py unimportable still gives
ctxpar.testing, ctxpar.attention and ctxpar.run_threads (a fresh interpreter: this one may
have imported mpi4py already). The extension itself links Debian's libmpi (docs/python.md,
"Without MPI")."""
import subprocess
import sys

CODE = """
import sys
sys.modules["mpi4py"] = None          # `import mpi4py` now raises ImportError
import numpy as np
import ctxpar
assert "mpi4py" not in [m for m in sys.modules if sys.modules[m] is not None]
assert callable(ctxpar.testing.check_shards)
q = np.random.default_rng(0).standard_normal((1, 16, 2, 16)).astype(np.float32)
out, lse = ctxpar.attention(q, q, q, ranks=2, mask="causal")
sizes = []
ctxpar.run_threads(2, lambda comm: sizes.append(comm.size))
assert sizes == [2, 2] and out.shape == q.shape
print("ok")
"""


def test_import_ctxpar_runs_without_mpi4py_and_brings_testing():
    run = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout + run.stderr

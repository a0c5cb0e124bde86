"""The package without MPI: the extension ctxpar._ctxpar links no libmpi; its MPI
transport is the plugin libctxpar_mpi.so, loaded only when MPI is asked for. With OpenMPI's
libraries hidden (a private mount namespace, `unshare -m`, an empty file bind-mounted over
each libmpi*.so, so that loading it fails), `import ctxpar`, the threads transport, a world of
one and a 2-process torchrun job over gloo all work and never map libmpi, and asking for MPI
raises one error naming libmpi.so.40 and the ways on."""
import glob
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import ctxpar
from conftest import TORCHRUN
from test_torch import run_ranks
from torchrun_case import attention_on

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE = os.path.dirname(ctxpar.__file__)
EXTENSION = glob.glob(os.path.join(PACKAGE, "_ctxpar*.so"))[0]
PLUGIN = os.path.join(PACKAGE, "libctxpar_mpi.so")


def needed(path):
    """The DT_NEEDED libraries of a shared object (readelf -d)."""
    out = subprocess.run(["readelf", "-d", path], capture_output=True, text=True,
                         check=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)


def libmpi_files():
    """The files behind every libmpi*.so the loader knows (ldconfig -p)."""
    out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    return sorted({os.path.realpath(line.split("=>")[1].strip())
                   for line in out.splitlines()
                   if "=>" in line and re.search(r"\blibmpi(_cxx)?\.so", line)})


def can_hide():
    if shutil.which("unshare") is None or not libmpi_files():
        return False
    run = subprocess.run(["unshare", "-m", "true"], capture_output=True)
    return run.returncode == 0


needs_hiding = pytest.mark.skipif(not can_hide(), reason="unshare -m unavailable (not root?) "
                                  "or no libmpi to hide; test_extension_links_no_libmpi still "
                                  "checks the extension")


def hidden(cmd, tmp_path, env=None, timeout=240, files=None):
    """Runs cmd in a private mount namespace where every libmpi file (or every one of `files`)
    is an empty file."""
    empty = tmp_path / "empty.so"
    empty.write_bytes(b"")
    script = 'for f in "$@"; do case $f in --) shift; break;; esac; ' \
             'mount --bind "$0" "$f" || exit 97; shift; done; exec "$@"'
    files = libmpi_files() if files is None else files
    argv = ["unshare", "-m", "sh", "-c", script, str(empty), *files, "--", *cmd]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ if env is None else env, OMP_NUM_THREADS="1"))


def test_extension_links_no_libmpi():
    libs = needed(EXTENSION)
    assert not [n for n in libs if n.startswith("libmpi")], \
        f"{os.path.basename(EXTENSION)} links {libs}: `import ctxpar` needs MPI"
    if os.path.exists(PLUGIN):  # built where OpenMPI's development files were found
        assert "libmpi.so.40" in needed(PLUGIN)


CHILD = textwrap.dedent("""
    import numpy as np
    import torch
    import ctxpar
    from conftest import problem, reference, visible
    q, k, v, dout = problem(T=32)
    out, lse = ctxpar.attention(q, k, v, ranks=2, strategy="ring", layout="zigzag",
                                mask="causal")
    ref = reference(*(torch.from_numpy(x) for x in (q, k, v, dout)), visible(32, "causal"))[0]
    print("threads max error", float(np.abs(out - ref.numpy()).max()))
    world = ctxpar.init()
    print("world", world.rank, world.size, world.transport)
    print("mpi:", ctxpar._ctxpar._mpi_unavailable())
    print("libmpi mapped:", "libmpi" in open("/proc/self/maps").read())
""")


@needs_hiding
def test_threads_and_a_world_of_one_run_with_libmpi_hidden(tmp_path):
    path = os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH")) if p)
    run = hidden([sys.executable, "-c", CHILD], tmp_path, env=dict(os.environ, PYTHONPATH=path))
    assert run.returncode == 0, run.stdout + run.stderr
    error = float(re.search(r"threads max error (\S+)", run.stdout).group(1))
    assert error < 1e-5, run.stdout
    assert "world 0 1 gloo" in run.stdout, run.stdout  # no launcher, no MPI: gloo's world of one
    assert "libmpi.so.40" in run.stdout  # the plugin could not load: MPI really was hidden
    assert "libmpi mapped: False" in run.stdout, run.stdout


@needs_hiding
@pytest.mark.skipif(TORCHRUN is None, reason="no torchrun beside the python")
def test_a_torchrun_job_over_gloo_runs_with_libmpi_hidden(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    run = hidden([TORCHRUN, "--standalone", "--nproc-per-node", "2",
                  os.path.join(HERE, "torchrun_case.py"), "torch", str(out)], tmp_path,
                 env=dict(os.environ, TMPDIR=str(tmp_path)))  # torchelastic_* folders there
    assert run.returncode == 0, run.stdout + run.stderr
    world = run_ranks(2, attention_on)
    for r in range(2):
        got = torch.load(out / f"rank{r}.pt")
        for name, a, b in zip(["out", "dq", "dk", "dv"], got["world"], world[r]):
            assert torch.equal(a, b), f"rank {r} {name}: gloo differs from threads"


@needs_hiding
def test_asking_for_mpi_with_libmpi_hidden_names_the_library_and_the_ways_on(tmp_path):
    child = textwrap.dedent("""
        import ctxpar
        for ask in (ctxpar.init, ctxpar._ctxpar._mpi_world):
            try:
                ask()
            except RuntimeError as e:
                print("refused:", e)
            else:
                print("not refused")
    """)
    env = dict(os.environ, OMPI_COMM_WORLD_SIZE="1", OMPI_COMM_WORLD_RANK="0")  # "mpirun"
    run = hidden([sys.executable, "-c", child], tmp_path, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert len(lines) == 2 and all(l.startswith("refused: MPI transport: cannot load ")
                                   for l in lines), run.stdout
    for part in ("libctxpar_mpi.so", "needs OpenMPI's libmpi.so.40", "install OpenMPI",
                 "torchrun", "gloo", "ctxpar.run_threads"):
        assert part in lines[0], (part, lines[0])

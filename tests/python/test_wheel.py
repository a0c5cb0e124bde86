"""The wheel installs anywhere (issue 38): scripts/wheel.sh's manylinux wheel (CI builds it
once, in scripts/test.sh's `wheel` stage, over the python-package stage's build) goes into a
fresh venv, and with the libraries of the project's -dev packages hidden (a private mount
namespace, an empty file bind-mounted over each, as test_no_mpi.py hides libmpi) `import
ctxpar`, ctxpar.attention and cp_attention over 2 thread ranks (checked against the fp64
reference) and the `ctxpar` command (`ctxpar --version`, a console entry point) all work, from
the libraries inside the wheel. Also: a missing dependency stops CMake's configure naming the
Debian package. Takes ~15 s (a venv, a pip install, two interpreters)."""
import glob
import os
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile

import pytest

from test_no_mpi import hidden

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WHEELS = sorted(glob.glob(os.path.join(ROOT, "build-python", "wheelhouse", "ctxpar-*.whl")))
# The runtime libraries of the -dev packages the build needs (setup.sh) and theirs: libgloo-dev
# (hiredis, ibverbs, libnl), libhwy-dev, libopenblas-dev (gfortran, quadmath), gcc's libgomp.
HIDE = (r"\blib(gloo|hwy|hwy_contrib|gomp|openblas\w*|gfortran|quadmath|blas|lapack|hiredis|"
        r"ibverbs|nl-3|nl-route-3)\.so")

needs_wheel = pytest.mark.skipif(
    not WHEELS, reason="no build-python/wheelhouse/ctxpar-*.whl: bash scripts/wheel.sh makes "
    "it (scripts/test.sh's wheel stage does, in CI)")


def hidden_files():
    """The files behind every library the loader knows that matches HIDE (ldconfig -p)."""
    out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    return sorted({os.path.realpath(line.split("=>")[1].strip())
                   for line in out.splitlines() if "=>" in line and re.search(HIDE, line)})


@needs_wheel
def test_the_wheel_is_manylinux_and_carries_its_libraries():
    wheel = WHEELS[-1]
    assert re.search(r"-manylinux_\d+_\d+_x86_64\.whl$", wheel), wheel
    names = zipfile.ZipFile(wheel).namelist()
    assert "ctxpar/bin/ctxpar" in names, names
    bundled = [n for n in names if n.startswith("ctxpar.libs/")]
    for lib in ("libgloo", "libhwy", "libgomp", "libopenblas"):
        assert any(os.path.basename(n).startswith(lib) for n in bundled), (lib, bundled)
    assert not any("libmpi" in n for n in bundled), bundled  # MPI stays the machine's


CHILD = textwrap.dedent("""
    import os, sys
    import numpy as np
    import torch
    import ctxpar
    assert ctxpar.__file__.startswith(sys.prefix), ctxpar.__file__  # the wheel's, not .venv's
    sys.path.insert(0, sys.argv[1])
    from conftest import problem, reference, visible
    from ctxpar import layout as cl
    from ctxpar.torch import cp_attention
    q, k, v, dout = problem(T=32)
    ok = visible(32, "causal")
    want = reference(*(torch.from_numpy(x) for x in (q, k, v, dout)), ok)[0].numpy()
    naive = reference(*(torch.from_numpy(x) for x in (q, k, v, dout)), ok,
                      dtype=torch.float32)[0].numpy()
    # accuracy_tolerance: 2 x the naive fp32 error + 1e-5 max(1, |fp64|)
    bound = 2 * np.abs(naive - want).max() + 1e-5 * max(1.0, np.abs(want).max())
    out, _ = ctxpar.attention(q, k, v, ranks=2, layout="zigzag", mask="causal")
    assert np.abs(out - want).max() <= bound, (np.abs(out - want).max(), bound)
    got = [None, None]
    def rank(comm):
        local = [cl.shard(torch.from_numpy(x), comm, layout="zigzag", seq_dim=1)
                 for x in (q, k, v)]
        o = cp_attention(*local, comm=comm, layout="zigzag", causal=True)
        got[comm.rank] = cl.unshard(o, comm, layout="zigzag", seq_dim=1).numpy()
    ctxpar.run_threads(2, rank)
    assert np.abs(got[0] - want).max() <= bound, (np.abs(got[0] - want).max(), bound)
    assert np.array_equal(got[0], got[1])
    maps = open("/proc/self/maps").read()
    print("mapped", sorted({os.path.basename(l.split()[-1]) for l in maps.splitlines()
                            if "ctxpar.libs" in l}))
    print("ok")
""")


@needs_wheel
@pytest.mark.skipif(shutil.which("unshare") is None, reason="unshare unavailable")
def test_the_wheel_runs_in_a_fresh_venv_without_the_dev_libraries(tmp_path):
    import numpy as np
    import torch
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    install = subprocess.run([sys.executable, "-m", "pip", "--python", py, "install", "-q",
                              "--no-deps", "--no-index", WHEELS[-1]],
                             capture_output=True, text=True, timeout=180)
    assert install.returncode == 0, install.stdout + install.stderr
    # torch and numpy from this environment, behind the venv's own site-packages (a .pth line
    # is appended to sys.path): the wheel's ctxpar comes first. (Written after the install, or
    # pip would take this environment's ctxpar for the wheel's, installed already.)
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    outer = {os.path.dirname(os.path.dirname(m.__file__)) for m in (torch, np)}
    with open(os.path.join(site, "outer.pth"), "w") as f:
        f.write("".join(f"{d}\n" for d in sorted(outer)))
    assert hidden_files(), "nothing to hide: the test would prove nothing"
    if subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0:
        pytest.skip("unshare -m needs root")

    def run(cmd):
        env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "PYTHONPATH")}
        return hidden(cmd, tmp_path, env=env, files=hidden_files())

    child = tmp_path / "child.py"
    child.write_text(CHILD)
    got = run([py, str(child), os.path.dirname(os.path.abspath(__file__))])
    assert got.returncode == 0 and got.stdout.endswith("ok\n"), got.stdout + got.stderr
    assert "libgloo" in got.stdout and "libhwy" in got.stdout, got.stdout
    version = run([str(venv / "bin" / "ctxpar"), "--version"])
    assert version.returncode == 0, version.stdout + version.stderr
    assert version.stdout.startswith("ctxpar "), version.stdout


def test_a_missing_dependency_names_the_debian_package(tmp_path):
    """Highway (the first the configure looks for) made unfindable: CMake stops naming the
    package to install, not with its search-path text."""
    cmake = shutil.which("cmake")
    if cmake is None:
        pytest.skip("no cmake")
    run = subprocess.run([cmake, "-S", ROOT, "-B", str(tmp_path / "b"),
                          "-DCMAKE_DISABLE_FIND_PACKAGE_hwy=ON", "-DCTXPAR_TESTS=OFF",
                          "-DCTXPAR_DEV=OFF", "-DCTXPAR_CCACHE=OFF"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    text = " ".join(run.stderr.split())
    assert "ctxpar needs hwy, which was not found: install Debian's libhwy-dev (apt-get " \
           "install libhwy-dev;" in text, run.stderr

"""Shared pieces of the Python tests: random problems, the fp64 PyTorch autograd reference
(plain softmax attention, written here, independent of ctxpar) and the project's tolerance
rule, from its one home (reference::accuracy_tolerance, through the extension):
max|ours - fp64| <= 2 * max|naive fp32 - fp64| + 1e-5 * max(1, max|fp64|)."""
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pytest
import torch

from ctxpar import _ctxpar

MPIRUN = shutil.which("mpirun")
# The torchrun of this interpreter's environment (the venv's), not another one on PATH.
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
TORCHRUN = TORCHRUN if os.access(TORCHRUN, os.X_OK) else None


def mpirun(ranks, script, *args, timeout=180):
    """`mpirun -n ranks python script args` as root, oversubscribed, one OpenMP thread."""
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMP_NUM_THREADS="1")
    cmd = [MPIRUN, "-n", str(ranks), "--oversubscribe", sys.executable, script, *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def torchrun(ranks, script, *args, timeout=240):
    """`torchrun --standalone --nproc-per-node ranks script args` (gloo, a free port), one
    OpenMP thread per worker. The agent's temporary folders (torchelastic_*, which it leaves
    behind) go to a TMPDIR of the call's own, removed when it returns."""
    with tempfile.TemporaryDirectory(prefix="ctxpar_torchrun_") as tmp:
        env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=tmp)
        cmd = [TORCHRUN, "--standalone", "--nproc-per-node", str(ranks), script, *args]
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def problem(B=2, T=32, Hq=4, Hkv=2, D=16, seed=0, dtype=np.float32):
    """Random q [B, T, Hq, D], k, v [B, T, Hkv, D] and dout like q, as NumPy arrays."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, Hq, D)).astype(dtype)
    k = rng.standard_normal((B, T, Hkv, D)).astype(dtype)
    v = rng.standard_normal((B, T, Hkv, D)).astype(dtype)
    dout = rng.standard_normal((B, T, Hq, D)).astype(dtype)
    return q, k, v, dout


def visible(T, mask="none", document_ids=None, positions=None):
    """[T, T] bool: may query i see key j (the rules of include/ctxpar/mask.h)."""
    pos = torch.arange(T) if positions is None else torch.as_tensor(positions)
    pq, pk = pos[:, None], pos[None, :]
    ok = torch.ones(T, T, dtype=torch.bool)
    if mask == "causal":
        ok &= pk <= pq
    elif isinstance(mask, tuple):
        _, left, right = mask
        if left >= 0:
            ok &= pq - pk <= left
        if right >= 0:
            ok &= pk - pq <= right
    if document_ids is not None:
        d = torch.as_tensor(document_ids)
        ok &= d[:, None] == d[None, :]
    return ok


def reference(q, k, v, dout, ok, dtype=torch.float64):
    """Softmax attention with autograd in `dtype`: (out, lse, dq, dk, dv) as float64 tensors.
    GQA: query head h reads kv head h // (Hq // Hkv)."""
    qt, kt, vt = (torch.tensor(np.asarray(x, np.float32), dtype=dtype, requires_grad=True)
                  for x in (q, k, v))
    group = qt.shape[2] // kt.shape[2]
    kk, vv = kt.repeat_interleave(group, dim=2), vt.repeat_interleave(group, dim=2)
    s = torch.einsum("bihd,bjhd->bhij", qt, kk) * qt.shape[3] ** -0.5
    s = s.masked_fill(~ok, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    out = torch.einsum("bhij,bjhd->bihd", torch.softmax(s, dim=-1), vv)
    out.backward(torch.tensor(np.asarray(dout, np.float32), dtype=dtype))
    return [x.detach().double() for x in (out, lse, qt.grad, kt.grad, vt.grad)]


def as64(x):
    if isinstance(x, torch.Tensor):
        return x.detach().double()
    return torch.from_numpy(np.asarray(x, np.float64))


def check_close(name, ours, ref64, naive32, floor=0.0, floor_rel=None):
    """The project's rule; `floor` adds a storage rounding term (bf16) where one applies;
    `floor_rel` replaces the rule's floor (the fast bf16 tier's 2^-7, docs/kernel.md)."""
    ours, ref64, naive32 = as64(ours), as64(ref64), as64(naive32)
    err = (ours - ref64).abs().max().item()
    base = (naive32 - ref64).abs().max().item()
    ref_max = ref64.abs().max().item()
    # The rule from its one home (ctxpar/reference.h accuracy_tolerance), plus the rounding.
    rule = {} if floor_rel is None else {"floor_rel": floor_rel}
    bound = _ctxpar._accuracy_tolerance(base, ref_max, **rule) + floor * max(1.0, ref_max)
    assert err <= bound, (f"{name}: max|ours - fp64| = {err:.3g} > bound {bound:.3g} "
                          f"(naive fp32 error {base:.3g})")


@pytest.fixture
def rng():
    return np.random.default_rng(1)

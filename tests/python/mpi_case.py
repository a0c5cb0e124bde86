"""One rank of an mpirun job (run by test_mpi.py): cp_attention forward and backward on this
rank's zigzag shard, gathered with ctxpar.layout.unshard and checked against the fp64
reference on every rank. argv[1]: "init" (ctxpar.init()) or "mpi4py"
(Communicator.from_mpi4py(MPI.COMM_WORLD)). Exit code 0 when every check holds."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ctxpar  # noqa: E402
from ctxpar import layout as cl  # noqa: E402
from ctxpar.torch import cp_attention  # noqa: E402
from conftest import check_close, problem, reference, visible  # noqa: E402

if sys.argv[1] == "mpi4py":
    from mpi4py import MPI
    comm = ctxpar.Communicator.from_mpi4py(MPI.COMM_WORLD)
    assert comm.size == MPI.COMM_WORLD.Get_size() and comm.rank == MPI.COMM_WORLD.Get_rank()
else:
    comm = ctxpar.init()
assert comm.transport == "mpi", comm.transport

T = 32
q, k, v, dout = problem(T=T)
local = [cl.shard(torch.from_numpy(x), comm, layout="zigzag", seq_dim=1) for x in (q, k, v, dout)]
qs, ks, vs = (x.clone().requires_grad_() for x in local[:3])
out = cp_attention(qs, ks, vs, comm=comm, layout="zigzag", causal=True)
(out * local[3]).sum().backward()
ours = [cl.unshard(x, comm, layout="zigzag", seq_dim=1) for x in (out, qs.grad, ks.grad, vs.grad)]
ok = visible(T, "causal")
ref, naive = reference(q, k, v, dout, ok), reference(q, k, v, dout, ok, dtype=torch.float32)
for name, o, r, n in zip(["out", "dq", "dk", "dv"], ours, [ref[0]] + ref[2:],
                         [naive[0]] + naive[2:]):
    check_close(name, o, r, n)
print(f"rank {comm.rank} of {comm.size}: ok", flush=True)

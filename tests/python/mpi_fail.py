"""One rank of an mpirun -n 2 job that goes wrong on purpose (run by test_mpi.py).
argv[1]:
  disagree  rank 1 passes another layout to cp_attention: both ranks must refuse it (exit 0
            after printing "rank R refused: <message>")
  raise     rank 1 raises a Python exception while rank 0 waits in cp_attention: the job must
            end at once naming rank 1, not after rank 0's 120 s timeout
  timeout   ctxpar.init(timeout_s=2); rank 1 sleeps: rank 0's wait fails after 2 s"""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ctxpar  # noqa: E402
from ctxpar import layout as cl  # noqa: E402
from ctxpar.torch import cp_attention  # noqa: E402
from conftest import problem  # noqa: E402

mode = sys.argv[1]
comm = ctxpar.init(timeout_s=2) if mode == "timeout" else ctxpar.init()
assert comm.transport == "mpi" and comm.size == 2, (comm.transport, comm.size)
layout = "striped" if mode == "disagree" and comm.rank == 1 else "zigzag"
local = [cl.shard(torch.from_numpy(x), comm, layout=layout, seq_dim=1) for x in problem(T=32)[:3]]

if mode == "disagree":
    try:
        cp_attention(*local, comm, layout=layout, causal=True)
    except ValueError as e:
        print(f"rank {comm.rank} refused: {e}", flush=True)
        sys.exit(0)
    print(f"rank {comm.rank}: not refused", flush=True)
    sys.exit(3)

if comm.rank == 1:
    if mode == "raise":
        raise RuntimeError("rank 1 gave up before attention")
    time.sleep(60)  # mode timeout: alive but silent (the job ends first)
cp_attention(*local, comm, layout=layout, causal=True)
print(f"rank {comm.rank}: attention returned", flush=True)

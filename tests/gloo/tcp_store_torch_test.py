"""ctxpar's own TCP store server (rank 0 hosts it when torchrun's agent does not) against
torch's TCPStore client: torch must validate, ping, wait for and read the address rank 0
published, its compare_set must find the job's size rank 0 claimed (torch's semantics: the
value stays, the answer is the value), and its set must reach rank 0, which then refuses the
bogus address naming it.

    python tcp_store_torch_test.py <ctxpar>     (the python of a venv with torch)
"""
import os
import socket
import subprocess
import sys
from datetime import timedelta

import torch.distributed as dist

ctxpar = sys.argv[1]
with socket.socket() as s:  # a free port
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
env = dict(os.environ, RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
           OMP_NUM_THREADS="1")
env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
rank0 = subprocess.Popen([ctxpar, "attention", "--seq", "64", "--heads", "2", "--head-dim", "16",
                          "--timeout", "30"], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30),
                      wait_for_workers=False)
address = store.get("ctxpar/gloo///0/0")  # run id, restart count: unset; first communicator
assert address.startswith(b"CTXPARG1"), address[:16]
world = store.compare_set("ctxpar/gloo///0/world", "", "3 (torch's client)")
assert world.startswith(b"2 (set by rank 0, pid "), world
assert store.compare_set("ctxpar/gloo///0/world", "", "3 (again)") == world
store.set("ctxpar/gloo///0/1", b"not an address")
out, err = rank0.communicate(timeout=60)
assert rank0.returncode != 0, (rank0.returncode, out, err)
assert "addresses[1] is not the address() of rank 1" in err, err
print("PASS: torch's TCPStore client read rank 0's address from ctxpar's store, and its set "
      "reached rank 0:", err.strip().splitlines()[0][:120])

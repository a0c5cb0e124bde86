"""One worker of a torchrun job (test_gloo_lifecycle.py) that checks how a process using
ctxpar's gloo communicators ends. argv[1]: endings, comma-separated; argv[2]: runs of each.

Each run is a child of this worker (os.fork, before this worker makes any thread or process
group, so that the runs cost no torch import): the children of the job's two workers form a
2-rank job of their own (init_process_group over the agent's store, a prefix per run), make a
communicator with Communicator.from_torch, run one cp_attention, and end their own way:
  destroy   torch.distributed.destroy_process_group(), then the interpreter's exit
  del       del comm, then exit (the process group left as it is)
  nothing   exit with everything alive
  loop      three times: a process group, from_torch, attention, destroy_process_group
The child's exit status is the verdict: 0, or what ended it (a signal: `terminate called
without an active exception` is SIGABRT). The worker prints one line per failed run and exits
1 if any run failed."""
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

import ctxpar
from ctxpar import layout as cl
from ctxpar.torch import cp_attention


def attention(comm):
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 32, 2, 16) for _ in range(3))
    local = [cl.shard(x, comm, layout="zigzag", seq_dim=1) for x in (q, k, v)]
    cp_attention(*local, comm=comm, layout="zigzag", causal=True)


def join(store, prefix, rank):
    dist.init_process_group("gloo", store=dist.PrefixStore(prefix, store), rank=rank,
                            world_size=2, timeout=timedelta(seconds=60))


def child(ending, run, rank):
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timedelta(seconds=60))
    prefix = f"ctxpar-lifecycle/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{ending}/{run}"
    if ending == "loop":
        previous = None
        for j in range(3):
            join(store, f"{prefix}/{j}", rank)
            comm = ctxpar.Communicator.from_torch(timeout_s=60)
            assert ctxpar.Communicator.from_torch() is comm  # one per group
            assert previous is None or previous.closed  # its group was destroyed
            attention(comm)
            dist.destroy_process_group()
            previous = comm
        return
    join(store, prefix, rank)
    comm = ctxpar.Communicator.from_torch(timeout_s=60)
    attention(comm)
    if ending == "destroy":
        dist.destroy_process_group()
    elif ending == "del":
        del comm
    else:
        assert ending == "nothing", ending


def main():
    endings, runs = sys.argv[1].split(","), int(sys.argv[2])
    rank = int(os.environ["RANK"])
    failed = 0
    for ending in endings:
        for run in range(runs):
            pid = os.fork()
            if pid == 0:
                child(ending, run, rank)
                sys.exit(0)  # through the interpreter's own exit, which is under test
            _, status = os.waitpid(pid, 0)
            if status != 0:
                failed += 1
                code = os.waitstatus_to_exitcode(status)
                print(f"rank {rank}: {ending} run {run} ended with "
                      f"{'signal ' + str(-code) if code < 0 else 'exit ' + str(code)}",
                      flush=True)
    print(f"rank {rank}: {failed} of {len(endings) * runs} runs failed", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

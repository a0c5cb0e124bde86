"""One worker of a torchrun job (run by test_torchrun.py). argv[1]:
  init      ctxpar.init() joins the job (or refuses it, naming torchrun); prints
            "rank R of P: <transport>"; a second init() returns the same communicator
  init_after_torch  the same after init_process_group("gloo") (from_torch on its group)
  torch     init_process_group("gloo"); Communicator.from_torch(): cp_attention forward and
            backward on this rank's zigzag shard, saved to argv[2]/rank{R}.pt for a bitwise
            comparison with the same call on run_threads; split into pairs and a 2-rank
            attention on each
  mesh      a (2, P/2) DeviceMesh ("dp", "cp"): context_parallel(mesh["cp"], ...) with an
            SDPA bound by `from torch.nn.functional import ...` before the block; the gathered
            output saved to argv[2]/mesh{R}.pt
  raise     rank 1 raises while rank 0 waits in cp_attention (default 120 s timeout): the job
            must end within seconds, naming rank 1"""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ctxpar  # noqa: E402
from ctxpar import layout as cl  # noqa: E402
from ctxpar.torch import context_parallel, cp_attention  # noqa: E402
from conftest import problem  # noqa: E402

# Imported by the tests for attention_on (pytest-xdist's workers have no argv[1]): no mode.
mode = sys.argv[1] if __name__ == "__main__" else None
out_dir = sys.argv[2] if __name__ == "__main__" and len(sys.argv) > 2 else None
T = 32


def attention_on(comm):
    """cp_attention forward + backward on comm's zigzag shards: (out, dq, dk, dv) shards."""
    q, k, v, dout = (torch.from_numpy(x) for x in problem(T=T))
    local = [cl.shard(x, comm, layout="zigzag", seq_dim=1) for x in (q, k, v, dout)]
    qs, ks, vs = (x.clone().requires_grad_() for x in local[:3])
    out = cp_attention(qs, ks, vs, comm=comm, layout="zigzag", causal=True)
    (out * local[3]).sum().backward()
    return [out.detach(), qs.grad, ks.grad, vs.grad]


if mode in ("init", "init_after_torch"):
    if mode == "init_after_torch":
        dist.init_process_group("gloo")
    try:
        comm = ctxpar.init(timeout_s=30)
    except RuntimeError as e:
        print(f"refused: {e}", flush=True)
        sys.exit(3)
    again = ctxpar.init(timeout_s=40)  # the same communicator, its timeout set anew
    assert again is comm and comm.timeout_s == 40, (again, comm.timeout_s)
    comm.barrier()
    print(f"rank {comm.rank} of {comm.size}: {comm.transport}", flush=True)
elif mode == "torch":
    dist.init_process_group("gloo")
    comm = ctxpar.Communicator.from_torch(timeout_s=30)
    assert (comm.rank, comm.size) == (dist.get_rank(), dist.get_world_size())
    result = {"world": attention_on(comm)}
    pair = comm.split(comm.rank // 2, comm.rank)
    assert (pair.rank, pair.size) == (comm.rank % 2, 2), (pair.rank, pair.size)
    assert pair.timeout_s == comm.timeout_s == 30
    result["pair"] = attention_on(pair)
    torch.save(result, os.path.join(out_dir, f"rank{comm.rank}.pt"))
    dist.destroy_process_group()
elif mode == "mesh":
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.functional import scaled_dot_product_attention as sdpa
    world = int(os.environ["WORLD_SIZE"])
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "cp"))
    q, k, v, _ = (torch.from_numpy(x).transpose(1, 2).contiguous() for x in problem(T=T))
    with context_parallel(mesh["cp"], buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
        out = sdpa(q, k, v, is_causal=True, enable_gqa=True)
    comm = ctxpar.Communicator.from_mesh(mesh, "cp")  # the block's, reused
    assert comm.size == world // 2 and comm.rank == mesh["cp"].get_local_rank()
    full = cl.unshard(out.transpose(1, 2), comm, layout="zigzag", seq_dim=1)
    torch.save(full, os.path.join(out_dir, f"mesh{dist.get_rank()}.pt"))
    dist.destroy_process_group()
elif mode == "raise":
    comm = ctxpar.init()
    local = [cl.shard(torch.from_numpy(x), comm, layout="zigzag", seq_dim=1)
             for x in problem(T=T)[:3]]
    if comm.rank == 1:
        import time
        print(f"rank 1 raises at {time.time():.3f}", flush=True)
        raise RuntimeError("rank 1 gave up before attention")
    cp_attention(*local, comm, layout="zigzag", causal=True)
    print(f"rank {comm.rank}: attention returned", flush=True)

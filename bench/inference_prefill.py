"""Prefill of T new tokens onto a cache of C tokens, pass-KV against pass-Q, alternating
(ctxpar.KVCache; bench/inference.sh runs it under mpirun -n 2, one rank per core). The cache
is filled with random K/V (append: no attention), then each mode prefills the same T tokens
onto a fresh copy of that cache. Prints one JSON line per run from rank 0: mode, wall seconds,
every rank's CPU seconds (its thread's), bytes sent (all ranks), the mode auto picks."""
import argparse
import json

import torch

import ctxpar


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cached", type=int, default=131072)
    p.add_argument("--new", type=int, default=4096)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(1)
    comm = ctxpar.init(timeout_s=1800)
    g = torch.Generator().manual_seed(1)
    D, C, T = a.head_dim, a.cached, a.new
    kc, vc = (torch.randn(1, C, a.kv_heads, D, generator=g) for _ in range(2))
    q = torch.randn(1, T, a.heads, D, generator=g)
    k, v = (torch.randn(1, T, a.kv_heads, D, generator=g) for _ in range(2))
    for _ in range(a.rounds):
        for mode in ("pass-kv", "pass-q"):
            cache = ctxpar.KVCache(comm, kv_heads=a.kv_heads, head_dim=D)
            cache.reserve([C + T])
            if C > 0:
                cache.append(kc, vc)
            comm.barrier()
            cache.prefill(q, k, v, mode=mode, return_lse=False)
            st = cache.last_stats
            mine = torch.tensor([st["wall_seconds"], st["cpu_seconds"], float(st["bytes_sent"])],
                                dtype=torch.float64)
            every = torch.zeros(comm.size * 3, dtype=torch.float64)
            comm.allgather(mine.numpy(), every.numpy())
            every = every.view(comm.size, 3)
            if comm.rank == 0:
                print(json.dumps(dict(
                    mode=mode, cached=C, new=T, ranks=comm.size,
                    wall_seconds=float(every[:, 0].max()),
                    cpu_seconds=[round(float(x), 4) for x in every[:, 1]],
                    bytes_sent=int(every[:, 2].sum()), auto=ctxpar.inference.predict_prefill_bytes(
                        C, T, comm.size, heads=a.heads, kv_heads=a.kv_heads,
                        head_dim=D)["auto"])), flush=True)


if __name__ == "__main__":
    main()

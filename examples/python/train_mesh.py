"""Trains train_cp.py's decoder on a 2-D torch DeviceMesh: data parallel over "dp" (DDP on
torch's gloo group, or FSDP2 with --fsdp), context parallel over "cp" (ctxpar, its own gloo
transport).

    torchrun --nproc-per-node 4 examples/python/train_mesh.py --dp 2 --cp 2 [--fsdp]
    python examples/python/train_mesh.py --batch 4   # one process, the same 4 sequences:
                                                     # the same losses, step by step

The global batch of dp * batch sequences is split by rows over "dp"; each sequence is split
over "cp" by the zigzag layout, and so are its labels and the global positions RoPE reads.
Attention is ctxpar.torch.cp_attention on the "cp" communicator
(ctxpar.Communicator.from_mesh(mesh, "cp")). Each rank's loss is its tokens' sum over dp's share (batch * T tokens); DDP
averages the gradients over "dp" and the ranks of "cp" add theirs (comm.allreduce), so every
rank takes the step of the global mean loss.
"""
import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

import ctxpar
from ctxpar import layout as cl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_cp import LAYOUT, Decoder, add_training_options, batch, sum_gradients  # noqa: E402


class Model(torch.nn.Module):
    """The decoder with its communicator bound, so that DDP sees forward(tokens, positions)."""

    def __init__(self, decoder, comm):
        super().__init__()
        self.decoder = decoder
        self.comm = comm

    def forward(self, tokens, positions):
        return self.decoder(tokens, positions, self.comm)


def train(mesh, args):
    dp, cp = mesh["dp"], mesh["cp"]
    comm = ctxpar.Communicator.from_mesh(mesh, "cp")
    dp_rank, dp_size = dp.get_local_rank(), dp.size()
    torch.manual_seed(args.seed)
    decoder = Decoder(args.vocab, args.dim, args.heads, args.layers, args.seed)
    model = Model(decoder, comm)
    if args.fsdp:  # FSDP2: parameters sharded over "dp" (DTensors), gathered for each pass
        from torch.distributed.fsdp import fully_shard
        fully_shard(model, mesh=dp)
    elif dp_size > 1:
        model = DistributedDataParallel(model, process_group=dp.get_group())
    params = list(decoder.parameters())  # after fully_shard: the sharded ones
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    positions = torch.from_numpy(cl.positions(args.seq, comm.size, comm.rank, LAYOUT))
    rows = slice(dp_rank * args.batch, (dp_rank + 1) * args.batch)
    losses = []
    for step in range(args.steps):
        data = batch(step, args.batch * dp_size, args.seq, args.vocab, args.seed)[rows]
        inputs = cl.shard(data[:, :-1], comm, layout=LAYOUT, seq_dim=1)
        labels = cl.shard(data[:, 1:], comm, layout=LAYOUT, seq_dim=1)
        logits = model(inputs, positions)
        loss = F.cross_entropy(logits.reshape(-1, args.vocab), labels.reshape(-1),
                               reduction="sum") / (args.batch * args.seq)
        opt.zero_grad(set_to_none=False)
        loss.backward()  # DDP / FSDP2: the mean over "dp"
        sum_gradients(params, comm)  # the sum over "cp"
        total = torch.tensor([loss.item()], dtype=torch.float64)
        comm.allreduce(total.numpy())
        if dp_size > 1:
            dist.all_reduce(total, group=dp.get_group())
        total /= dp_size
        opt.step()
        losses.append(total.item())
        if dist.get_rank() == 0:
            print(f"step {step:3d}  loss {total.item():.8f}", flush=True)
    return losses


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dp", type=int, default=1, help="data-parallel degree (mesh dim 'dp')")
    p.add_argument("--cp", type=int, default=1, help="context-parallel degree (mesh dim 'cp')")
    add_training_options(p, steps=20, batch_help="sequences per dp rank")
    p.add_argument("--fsdp", action="store_true",
                   help="FSDP2 (torch.distributed.fsdp.fully_shard) over 'dp' instead of DDP")
    p.add_argument("--losses", help="write the per-step losses to this JSON file (rank 0)")
    args = p.parse_args()
    torch.set_num_threads(1)
    if ctxpar.launched_by() is None:  # one process: a 1 x 1 mesh of its own, no ports
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.dp * args.cp != world:
        sys.exit(f"train_mesh.py: --dp {args.dp} x --cp {args.cp} must be the job's "
                 f"WORLD_SIZE {world}")
    mesh = init_device_mesh("cpu", (args.dp, args.cp), mesh_dim_names=("dp", "cp"))
    losses = train(mesh, args)
    if args.losses and dist.get_rank() == 0:
        with open(args.losses, "w") as f:
            json.dump({"losses": losses, "dp": args.dp, "cp": args.cp}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

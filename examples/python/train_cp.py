"""Trains a small PyTorch decoder whose attention runs across ranks with ctxpar.

    mpirun -n 4 python examples/python/train_cp.py      # 4 processes, one rank each
    torchrun --nproc-per-node 4 examples/python/train_cp.py    # the same over gloo
    mpirun -n 1 python examples/python/train_cp.py      # the same losses, step by step
    python examples/python/train_cp.py --threads 4      # 4 ranks as threads of one process

Each rank holds its zigzag share of every sequence (ctxpar.layout.shard). Everything but
attention works on local tokens only: embedding, RMSNorm, projections, RoPE at the tokens'
*global* positions, MLP, loss. Attention is ctxpar.torch.cp_attention (ring, causal), whose
backward is the ring's. Weights are replicated; gradients and the loss are summed over the
ranks (comm.allreduce, in place on the gradients' memory), so every rank takes the same step.
The task: arithmetic sequences mod V (x_t = a + b t), so the loss only falls if attention
reaches earlier tokens, most of them held by other ranks.
"""
import argparse
import json
import math

import torch
import torch.nn.functional as F

import ctxpar
from ctxpar import layout as cl
from ctxpar.torch import cp_attention

LAYOUT = "zigzag"


def rms_norm(x, weight, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope(x, positions, base=10000.0):
    """x [B, Tl, H, D] rotated by its tokens' global positions [Tl]."""
    half = x.shape[-1] // 2
    inv = base ** (-torch.arange(half, dtype=torch.float64) / half)
    angle = (positions.double()[:, None] * inv[None, :]).float()  # [Tl, D/2]
    cos, sin = angle.cos()[None, :, None, :], angle.sin()[None, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Decoder(torch.nn.Module):
    def __init__(self, vocab, dim, heads, layers, seed):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)  # per model: ranks may be threads

        def weight(*shape):
            return torch.nn.Parameter(torch.randn(*shape, generator=gen) / math.sqrt(shape[-1]))

        self.heads = heads
        self.embed = weight(vocab, dim)
        self.blocks = torch.nn.ModuleList()
        for _ in range(layers):
            block = torch.nn.ParameterDict(dict(
                norm1=torch.nn.Parameter(torch.ones(dim)), qkv=weight(3 * dim, dim),
                proj=weight(dim, dim), norm2=torch.nn.Parameter(torch.ones(dim)),
                up=weight(4 * dim, dim), down=weight(dim, 4 * dim)))
            self.blocks.append(block)
        self.norm = torch.nn.Parameter(torch.ones(dim))

    def forward(self, tokens, positions, comm):
        """tokens [B, Tl] (this rank's share), positions [Tl] global -> logits [B, Tl, V]."""
        x = self.embed[tokens]
        B, Tl, C = x.shape
        for w in self.blocks:
            h = rms_norm(x, w["norm1"]) @ w["qkv"].t()
            q, k, v = h.view(B, Tl, 3, self.heads, C // self.heads).unbind(2)  # strided views
            a = cp_attention(rope(q, positions), rope(k, positions), v, comm=comm,
                             layout=LAYOUT, causal=True)
            x = x + a.reshape(B, Tl, C) @ w["proj"].t()
            x = x + F.gelu(rms_norm(x, w["norm2"]) @ w["up"].t()) @ w["down"].t()
        return rms_norm(x, self.norm) @ self.embed.t()


def sum_gradients(params, comm):
    """Every parameter's gradient summed over the ranks of comm, in one allreduce. A sharded
    parameter (FSDP2's DTensor, train_mesh.py --fsdp) sums its local shard: the ranks of comm
    hold the same shard."""
    grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    comm.allreduce(flat.numpy())  # in place, zero-copy: flat's memory
    offset = 0
    for g in grads:
        g.copy_(flat[offset: offset + g.numel()].view_as(g))
        offset += g.numel()


def batch(step, batch_size, seq, vocab, seed):
    """[B, T + 1] tokens: x_t = (a + b t) mod V with random a, b per row; the next token
    follows from earlier ones (b), so the loss falls only through attention."""
    gen = torch.Generator().manual_seed(seed * 1000003 + step)
    a = torch.randint(vocab, (batch_size, 1), generator=gen)
    b = torch.randint(1, vocab, (batch_size, 1), generator=gen)
    return (a + b * torch.arange(seq + 1)[None, :]) % vocab


def train(comm, args):
    torch.manual_seed(args.seed)
    model = Decoder(args.vocab, args.dim, args.heads, args.layers, args.seed)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    positions = torch.from_numpy(cl.positions(args.seq, comm.size, comm.rank, LAYOUT))
    losses = []
    for step in range(args.steps):
        data = batch(step, args.batch, args.seq, args.vocab, args.seed)
        inputs = cl.shard(data[:, :-1], comm, layout=LAYOUT, seq_dim=1)
        labels = cl.shard(data[:, 1:], comm, layout=LAYOUT, seq_dim=1)
        logits = model(inputs, positions, comm)
        # This rank's share of the global mean: sum over local tokens / all tokens.
        loss = F.cross_entropy(logits.reshape(-1, args.vocab), labels.reshape(-1),
                               reduction="sum") / (args.batch * args.seq)
        opt.zero_grad(set_to_none=False)
        loss.backward()
        sum_gradients(params, comm)
        total = torch.tensor([loss.item()], dtype=torch.float64)
        comm.allreduce(total.numpy())
        opt.step()
        losses.append(total.item())
        if comm.rank == 0:
            print(f"step {step:3d}  loss {total.item():.8f}", flush=True)
    return losses


def add_training_options(p, steps, batch_help):
    """The options train_cp.py and train_mesh.py share."""
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence (divisible by 2P)")
    p.add_argument("--batch", type=int, default=2, help=batch_help)
    p.add_argument("--vocab", type=int, default=32)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_training_options(p, steps=30, batch_help="sequences per step")
    p.add_argument("--threads", type=int, default=1,
                   help="ranks as threads of this process (without a launcher)")
    p.add_argument("--losses", help="write the per-step losses to this JSON file (rank 0)")
    args = p.parse_args()
    torch.set_num_threads(1)

    results = {}

    def run(comm):
        losses = train(comm, args)
        if comm.rank == 0:
            results["losses"] = losses
            results["ranks"] = comm.size

    if ctxpar.launched_by() is not None:  # mpirun, torchrun: one rank per process
        run(ctxpar.init())
    else:
        ctxpar.run_threads(args.threads, run)
    if args.losses and "losses" in results:
        with open(args.losses, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()

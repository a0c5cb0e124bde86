"""Trains a random-init Hugging Face Llama with context parallelism: attn_implementation="ctxpar".

    python examples/python/train_hf.py                   # 2 ranks as threads of one process
    python examples/python/train_hf.py --threads 1       # the same losses on one rank
    torchrun --nproc-per-node 4 examples/python/train_hf.py    # one rank per process (gloo)
    torchrun --nproc-per-node 1 examples/python/train_hf.py    # one rank: the same losses
    mpirun -n 4 python examples/python/train_hf.py       # the same under MPI

Every step packs documents of random lengths into one sequence (document_ids), shards it with
ctxpar.hf.shard_batch (input_ids, per-document position_ids, labels shifted before sharding,
the global count of scored tokens), runs the model on this rank's share with gradient
checkpointing, and sums the gradients over the ranks (ctxpar.hf.all_reduce_gradients), so every
rank takes the step of the whole sequence. Documents are arithmetic sequences mod V, so the loss
falls only through attention, most of it across ranks. Nothing is downloaded.
"""
import argparse
import copy
import json
import os

import torch

import ctxpar
from ctxpar import hf


def make_model(args):
    """A small random-init Llama (the same weights on every rank: one seed)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.dim,
                         intermediate_size=2 * args.dim, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.heads // 2,
                         max_position_embeddings=args.seq, attention_dropout=0.0)
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config)
    model.set_attn_implementation("ctxpar")
    if args.checkpointing != "off":
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={
            "use_reentrant": args.checkpointing == "reentrant"})
    return model.train()


def packed_batch(step, args):
    """input_ids [B, T] and document_ids [T]: documents of 4..T/2 tokens, x_t = a + b t mod V
    (the same packing in every row; random a, b per document and row)."""
    gen = torch.Generator().manual_seed(args.seed * 1000003 + step)
    lengths, left = [], args.seq
    while left > 0:
        n = min(left, int(torch.randint(4, args.seq // 2 + 1, (1,), generator=gen)))
        lengths.append(n)
        left -= n
    docs = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    rows = []
    for _ in range(args.batch):
        parts = []
        for n in lengths:
            a, b = torch.randint(args.vocab, (2,), generator=gen)
            parts.append((a + (b % (args.vocab - 1) + 1) * torch.arange(n)) % args.vocab)
        rows.append(torch.cat(parts))
    return {"input_ids": torch.stack(rows), "document_ids": docs}


def train(comm, model, args):
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    losses = []
    for step in range(args.steps):
        local = hf.shard_batch(packed_batch(step, args), comm, layout="zigzag")
        loss = model(**local, use_cache=False).loss  # this rank's share of the global mean
        loss.backward()
        hf.all_reduce_gradients(model, comm)  # the gradient of the whole sequence
        opt.step()
        opt.zero_grad()
        # The loss of the whole sequence: the ranks' shares summed.
        total = torch.tensor([loss.item()], dtype=torch.float64)
        comm.allreduce(total.numpy())
        losses.append(total.item())
        if comm.rank == 0:
            print(f"step {step:3d}  loss {losses[-1]:.8f}", flush=True)
    return losses


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seq", type=int, default=64, help="tokens per packed sequence (divisible "
                   "by 2 x ranks)")
    p.add_argument("--batch", type=int, default=2, help="packed sequences per step")
    p.add_argument("--vocab", type=int, default=32)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4, help="query heads (kv heads: half)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpointing", choices=["off", "reentrant", "non-reentrant"],
                   default="non-reentrant", help="gradient checkpointing of every layer")
    p.add_argument("--threads", type=int, default=2,
                   help="ranks as threads of this process (without a launcher)")
    p.add_argument("--losses", help="write the per-step losses to this JSON file (rank 0)")
    return p.parse_args(argv)


def launched():
    """Started by mpirun or torchrun, of one worker too (ctxpar.launched_by() counts only
    launchers of several; without one this script runs threads)."""
    return ctxpar.launched_by() is not None or bool(os.environ.get("TORCHELASTIC_RUN_ID"))


def run(args):
    """{losses, ranks} of rank 0: one rank per process under a launcher, else threads."""
    torch.set_num_threads(1)
    hf.register()
    model = make_model(args)  # before the threads start: the seed is process-wide
    results = {}

    def rank(comm, m):
        losses = train(comm, m, args)
        if comm.rank == 0:
            results.update(losses=losses, ranks=comm.size)

    if launched():
        rank(ctxpar.init(), model)
    else:
        replicas = [copy.deepcopy(model) for _ in range(args.threads)]
        ctxpar.run_threads(args.threads, lambda comm: rank(comm, replicas[comm.rank]))
    return results


def main():
    args = parse()
    results = run(args)
    if args.losses and "losses" in results:
        with open(args.losses, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()

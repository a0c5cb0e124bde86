"""Greedy generation with a small causal transformer whose KV cache is spread over ranks
(ctxpar.KVCache): prefill the prompts, then decode N tokens per sequence; checks that the
tokens equal those of one rank holding the whole cache.

    mpirun -n 4 python examples/python/generate.py            # 4 processes, one rank each
    torchrun --nproc-per-node 2 examples/python/generate.py   # the same over gloo
    python examples/python/generate.py --threads 4            # 4 ranks as threads

The model is train_cp.py's Decoder (fixed seed, untrained: the tokens are arbitrary but
deterministic). Activations are replicated (every rank runs the same dense layers on the same
tokens); each layer's attention reads a KVCache that keeps on each rank only its share of the
keys and values (block round-robin), so the cache's memory is split P ways. B sequences with
prompts of different lengths prefill one by one (pass-KV / pass-Q, --mode) and decode together.
The reference runs the same model on a world of one rank (comm.split), whose cache is whole.
Prints both token lists and exits 1 when they differ.
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F

import ctxpar

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_cp import Decoder, rms_norm  # noqa: E402


def rope_at(x, positions, base=10000.0):
    """x [B, T, H, D] rotated by positions [B, T] (each sequence at its own place)."""
    half = x.shape[-1] // 2
    inv = base ** (-torch.arange(half, dtype=torch.float64) / half)
    angle = (positions.double()[..., None] * inv).float()[:, :, None, :]  # [B, T, 1, D/2]
    cos, sin = angle.cos(), angle.sin()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def forward(model, caches, tokens, positions, attend):
    """tokens, positions [B, T] -> logits of the last row [B, V]; attend(cache, q, k, v) runs
    one layer's attention and stores k, v."""
    x = model.embed[tokens]
    B, T, C = x.shape
    H = model.heads
    for w, cache in zip(model.blocks, caches):
        h = rms_norm(x, w["norm1"]) @ w["qkv"].t()
        q, k, v = h.view(B, T, 3, H, C // H).unbind(2)
        a = attend(cache, rope_at(q, positions), rope_at(k, positions), v.contiguous())
        x = x + a.reshape(B, T, C) @ w["proj"].t()
        x = x + F.gelu(rms_norm(x, w["norm2"]) @ w["up"].t()) @ w["down"].t()
    return (rms_norm(x[:, -1], model.norm) @ model.embed.t())


@torch.no_grad()
def generate(comm, args, prompts):
    model = Decoder(args.vocab, args.dim, args.heads, args.layers, args.seed)
    B = len(prompts)
    caches = [ctxpar.KVCache(comm, kv_heads=args.heads, head_dim=args.dim // args.heads,
                             sequences=B, block=args.block, dtype=args.dtype)
              for _ in range(args.layers)]
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    cast = (lambda *t: [x.to(dtype) for x in t])
    nxt = []
    for s, prompt in enumerate(prompts):  # prefill, one sequence at a time
        logits = forward(model, caches, prompt[None], torch.arange(len(prompt))[None],
                         lambda c, q, k, v: c.prefill(*cast(q, k, v), seq=s, mode=args.mode,
                                                      return_lse=False).float())
        nxt.append(int(logits.argmax(-1)))
    out = [[t] for t in nxt]
    for _ in range(args.tokens - 1):  # decode all sequences together
        lengths = caches[0].lengths
        logits = forward(model, caches, torch.tensor(nxt)[:, None],
                         torch.tensor(lengths)[:, None],
                         lambda c, q, k, v: c.decode(*cast(q, k, v), return_lse=False).float())
        nxt = logits.argmax(-1).tolist()
        for s, t in enumerate(nxt):
            out[s].append(t)
    memory = caches[0].nbytes * args.layers
    return out, memory


def prompts_of(args):
    gen = torch.Generator().manual_seed(args.seed + 1)
    lengths = [int(n) for n in args.prompts.split(",")]
    return [torch.randint(args.vocab, (n,), generator=gen) for n in lengths]


def run(comm, args, results):
    prompts = prompts_of(args)
    spread, memory = generate(comm, args, prompts)
    whole, whole_memory = generate(comm.split(comm.rank), args, prompts)  # one rank, all of it
    compare(comm, results, "sequence", spread, whole,
            f"ranks {comm.size} ({comm.transport}), {len(prompts)} prompts of "
            f"{[len(p) for p in prompts]} tokens, {args.tokens} generated, "
            f"KV cache on rank 0: {memory} B (whole: {whole_memory} B)")


def compare(comm, results, name, spread, whole, header):
    """Rank 0 prints the header and each sequence's tokens, spread and whole; results[rank]
    says whether they are equal (serve.py shares it)."""
    if comm.rank == 0:
        print(header, flush=True)
        for s, (a, b) in enumerate(zip(spread, whole)):
            print(f"{name} {s} spread: {a}", flush=True)
            print(f"{name} {s} whole:  {b}", flush=True)
    results[comm.rank] = spread == whole


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", default="45,29", help="prompt lengths, comma-separated")
    p.add_argument("--tokens", type=int, default=12, help="tokens to generate per sequence")
    model_arguments(p)
    p.add_argument("--mode", default="auto", choices=["auto", "pass-kv", "pass-q"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    launch(run, p.parse_args())


def model_arguments(p):
    """The model's and the launch's options (serve.py shares them)."""
    p.add_argument("--vocab", type=int, default=32)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--block", type=int, default=8, help="the cache's placement block")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="ranks as threads of this process (without a launcher)")


def launch(run, args):
    """run(comm, args, results) on each rank (one per process under mpirun / torchrun, else
    --threads threads); exits 1 when a rank's result is False (its tokens differ)."""
    torch.set_num_threads(1)
    results = {}
    if ctxpar.launched_by() is not None:  # mpirun, torchrun: one rank per process
        run(ctxpar.init(), args, results)
    else:
        ctxpar.run_threads(args.threads, lambda comm: run(comm, args, results))
    ok = all(results.values())
    if 0 in results:
        print("same tokens as one rank with the whole cache" if ok else
              "DIFFERENT tokens from one rank with the whole cache", flush=True)
    sys.exit(0 if ok else 1)

if __name__ == "__main__":
    main()

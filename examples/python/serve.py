"""A minimal serving loop over a KV cache spread across ranks (ctxpar.KVCache's slots):
requests with prompts of different lengths wait in a queue; at each step the server admits as
many as there are free slots (add(): a finished request's slot is reused), prefills their
prompts in one call, then decodes one token of every running request in one call (continuous
batching: seqs=[...]); a request that has its tokens is freed. Checks that every request's
tokens equal those of the same loop on one rank holding the whole cache.

    torchrun --nproc-per-node 2 examples/python/serve.py   # 2 processes over gloo
    mpirun -n 2 python examples/python/serve.py            # 2 processes over MPI
    python examples/python/serve.py --threads 2            # 2 ranks as threads

The model is generate.py's (train_cp.py's Decoder, fixed seed, untrained: the tokens are
arbitrary but deterministic); activations are replicated, each rank keeps its share of every
layer's keys and values. Prints each request's tokens, spread and whole, and exits 1 when they
differ. docs/inference.md, "A server's cache".
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F

import ctxpar

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from generate import compare, forward, launch, model_arguments, rope_at  # noqa: E402
from train_cp import Decoder, rms_norm  # noqa: E402


def prefill_prompts(model, caches, prompts, slots):
    """The prompts (token tensors of any lengths) of sequences `slots`, one prefill call per
    layer for all of them -> each prompt's last-row logits [V]."""
    xs = [model.embed[p][None] for p in prompts]  # [1, T_i, C] each
    C, H = xs[0].shape[-1], model.heads
    for w, cache in zip(model.blocks, caches):
        qs, ks, vs = [], [], []
        for x in xs:
            T = x.shape[1]
            q, k, v = (rms_norm(x, w["norm1"]) @ w["qkv"].t()).view(1, T, 3, H, C // H).unbind(2)
            at = torch.arange(T)[None]
            qs.append(rope_at(q, at))
            ks.append(rope_at(k, at))
            vs.append(v.contiguous())
        outs = cache.prefill(qs, ks, vs, seq=slots, return_lse=False)  # one call, all prompts
        for i, (x, a) in enumerate(zip(xs, outs)):
            x = x + a.reshape(x.shape) @ w["proj"].t()
            xs[i] = x + F.gelu(rms_norm(x, w["norm2"]) @ w["up"].t()) @ w["down"].t()
    return [rms_norm(x[0, -1], model.norm) @ model.embed.t() for x in xs]


@torch.no_grad()
def serve(comm, args, requests):
    """requests: [(prompt tokens, tokens to generate)] in arrival order -> each request's
    generated tokens, and the slot each one got (in admission order)."""
    model = Decoder(args.vocab, args.dim, args.heads, args.layers, args.seed)
    caches = [ctxpar.KVCache(comm, kv_heads=args.heads, head_dim=args.dim // args.heads,
                             sequences=0, block=args.block) for _ in range(args.layers)]
    waiting = list(range(len(requests)))
    running = {}  # slot -> request index
    tokens = [[] for _ in requests]
    slots_given = []
    while waiting or running:
        admitted = []
        while waiting and len(running) + len(admitted) < args.slots:
            r = waiting.pop(0)
            slot = {c.add() for c in caches}  # every layer's cache gives the same slot
            assert len(slot) == 1, slot
            admitted.append((slot.pop(), r))
        if admitted:
            logits = prefill_prompts(model, caches, [requests[r][0] for _, r in admitted],
                                     [s for s, _ in admitted])
            for (slot, r), lg in zip(admitted, logits):
                running[slot] = r
                slots_given.append(slot)
                tokens[r].append(int(lg.argmax()))
        # Requests that have all their tokens leave before the decode.
        for slot, r in list(running.items()):
            if len(tokens[r]) == requests[r][1]:
                for c in caches:
                    c.free(slot)
                del running[slot]
        if not running:
            continue
        seqs = sorted(running)
        last = torch.tensor([tokens[running[s]][-1] for s in seqs])[:, None]
        positions = torch.tensor([caches[0].tokens(s) for s in seqs])[:, None]
        logits = forward(model, caches, last, positions,
                         lambda c, q, k, v: c.decode(q, k, v, seqs=seqs, return_lse=False))
        for s, t in zip(seqs, logits.argmax(-1).tolist()):
            tokens[running[s]].append(t)
    return tokens, slots_given


def requests_of(args):
    gen = torch.Generator().manual_seed(args.seed + 1)
    lengths = [int(n) for n in args.prompts.split(",")]
    new = [int(n) for n in args.new_tokens.split(",")]
    if len(new) != len(lengths):
        raise SystemExit(f"--new-tokens: give one count per prompt ({len(lengths)}), got "
                         f"{len(new)}")
    return [(torch.randint(args.vocab, (n,), generator=gen), m) for n, m in zip(lengths, new)]


def run(comm, args, results):
    requests = requests_of(args)
    spread, slots = serve(comm, args, requests)
    whole, _ = serve(comm.split(comm.rank), args, requests)  # one rank, all of the cache
    compare(comm, results, "request", spread, whole,
            f"ranks {comm.size} ({comm.transport}), {len(requests)} requests of "
            f"{[len(p) for p, _ in requests]} prompt tokens through {args.slots} slots "
            f"(slots given in turn: {slots})")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", default="23,7,41,15,30,9", help="prompt lengths, in arrival order")
    p.add_argument("--new-tokens", default="5,9,3,7,4,6", help="tokens to generate per request")
    p.add_argument("--slots", type=int, default=3, help="requests served at once")
    model_arguments(p)
    launch(run, p.parse_args())

if __name__ == "__main__":
    main()

"""Whole-tensor attention: [B, T, H, D] in, [B, T, H, D] out; P ranks run as threads of this
process (shard by the layout, run the strategy, unshard)."""
from . import _ctxpar
from . import _checks
from ._arrays import (Tensors, check_attention_shapes, check_lse, check_same_shape,
                      check_writable_out, int_array)


def mask_text(mask):
    """"none" | "causal" | ("window", L, R) | any text of the CLI's --mask ("causal+window:L,R")."""
    if isinstance(mask, str):
        return mask
    if isinstance(mask, (tuple, list)) and len(mask) == 3 and mask[0] in ("window",
                                                                         "causal+window"):
        kind, left, right = mask
        left = _checks.whole("mask", left, -(1 << 62), 1 << 62)
        right = _checks.whole("mask", right, -(1 << 62), 1 << 62)
        return f"{kind}:{left},{right}"
    raise ValueError(f"mask: expected 'none', 'causal', ('window', L, R) or a mask text such as "
                     f"'causal+window:L,R', got {mask!r}")


def options(strategy="ring", layout="zigzag", mask="none", document_ids=None, positions=None,
            ulysses_degree=0, head_groups=0, threads=1, scale=None, bf16_tier="exact"):
    """The options every entry point shares, checked (ctxpar._checks), by the names of
    _ctxpar._JobArgs."""
    return dict(strategy=_checks.choice("strategy", strategy, _checks.STRATEGIES),
                layout=_checks.choice("layout", layout, _checks.LAYOUTS), mask=mask_text(mask),
                positions=int_array(positions, "positions", "int64"),
                documents=int_array(document_ids, "document_ids", "int32"),
                ulysses_degree=_checks.whole("ulysses_degree", ulysses_degree, 0,
                                             _checks.MAX_PROCESSES),
                head_groups=_checks.whole("head_groups", head_groups, 0, _checks.MAX_HEADS),
                threads=_checks.threads(threads), scale=_checks.scale(scale),
                bf16_tier=_checks.bf16_tier(bf16_tier))


def job_args(*args, **kwargs):
    """options(...) packed for C++."""
    return _ctxpar._JobArgs(**options(*args, **kwargs))


def _cuda_shards(t, ranks, layout):
    """Whole CUDA tensors: each rank's token indices by the layout (an index tensor on the
    tensors' device). The CPU path pads T to the layout's granule; on CUDA T must be a multiple
    of it."""
    T = t["q"].shape[1]
    granule = _ctxpar._layout_granule(layout, ranks)
    if T % granule:
        rule = "2P" if layout == "zigzag" else "P"
        raise ValueError(f"q: T = {T} tokens of CUDA tensors cannot be cut into ranks={ranks} "
                         f"equal shards by the {layout} layout (it needs T % {rule} == 0, a "
                         f"multiple of {granule}); ctxpar.attention pads CPU tensors only: pad "
                         f"the sequence to {-(-T // granule) * granule} tokens, or change ranks")
    import torch
    return [torch.as_tensor(_ctxpar._layout_positions(layout, T, ranks, r),
                            device=t["q"].device) for r in range(ranks)]


def _on_cuda_ranks(t, ranks, layout, args, inputs, outputs):
    """Whole CUDA tensors on `ranks` ranks (threads of this process, each with a cuda device on
    the tensors' GPU; transfers between them staged through host memory): inputs are gathered
    into each rank's shard on the GPU, the strategy runs on the shards in place, and the
    results are scattered into `outputs`. inputs / outputs: lists of (tensor, token dim)."""
    forward = len(outputs) == 2
    shards = []
    for index in _cuda_shards(t, ranks, layout):
        ins = [x.index_select(dim, index) for x, dim in inputs]
        outs = [x.new_empty(tuple(x.shape[:dim]) + (len(index),) + tuple(x.shape[dim + 1:]))
                for x, dim in outputs]
        shards.append((index, ins, outs))
    cuda_index = t.launch()

    def rank(comm):
        _, ins, outs = shards[comm.rank]
        run = _ctxpar._local_forward if forward else _ctxpar._local_backward
        run(comm, *ins, *outs, args, cuda_index)

    _ctxpar.run_threads(ranks, rank, _checks.timeout_s(120.0))
    for index, _, outs in shards:
        for (x, dim), o in zip(outputs, outs):
            x.index_copy_(dim, index, o)


def attention(q, k, v, *, ranks=1, strategy="ring", layout="zigzag", mask="none",
              document_ids=None, positions=None, return_lse=True, out=None, ulysses_degree=0,
              head_groups=0, threads=1, scale=None, bf16_tier="exact"):
    """Exact attention of whole tensors, computed by `ranks` ranks (threads) with `strategy`.

    q [B, T, Hq, D]; k, v [B, T, Hkv, D] (Hq % Hkv == 0): NumPy arrays or torch tensors (CPU, or
    all on one GPU: docs/python.md, "CUDA tensors"), float32 / bfloat16 / float16 (float16 is widened to float32 and the result narrowed back).
    mask: "none" | "causal" | ("window", L, R) | "causal+window:L,R" ...; document_ids (T ints)
    adds the documents rule (attention only inside a document); positions (T ints) replaces the
    global positions 0..T-1 the mask reads. Returns (out [B, T, Hq, D], lse [B, Hq, T] float32),
    or out alone with return_lse=False. `out` may be given (written in place, returned as is;
    writable, no two elements sharing memory). scale: None (1/sqrt(D)) or a positive finite
    number. bf16_tier: "exact" (every product of the stored bfloat16 values) or "fast" (P and dS
    rounded to bfloat16, as GPU flash attention; docs/kernel.md, "bf16 tiers"); float32 and
    float16 inputs ignore it. Every number is range-checked as the command's options (docs/python.md, "Argument
    checks")."""
    ranks = _checks.ranks(ranks)
    t = Tensors({"q": q, "k": k, "v": v})
    check_attention_shapes(t["q"], t["k"], t["v"])
    B, T, Hq, D = t["q"].shape
    if out is not None:
        if t.converted:
            raise TypeError("out: not supported with float16 inputs (the result is converted)")
        Tensors({"q": q, "out": out})
        check_writable_out("out", out)
        check_same_shape("out", out, (B, T, Hq, D), "q's [B, T, Hq, D]")
        result = out.detach() if t.kind == "torch" else out
    else:
        result = t.empty((B, T, Hq, D))
    lse = t.empty((B, Hq, T), like_dtype=False)
    args = job_args(strategy, layout, mask, document_ids, positions, ulysses_degree, head_groups,
                    threads, scale, bf16_tier)
    if t.cuda_index >= 0:
        _on_cuda_ranks(t, ranks, layout, args, [(t[n], 1) for n in ("q", "k", "v")],
                       [(result, 1), (lse, 2)])
    else:
        _ctxpar._forward(t["q"], t["k"], t["v"], result, lse, ranks, args)
    result = out if out is not None else t.restore(result)
    return (result, lse) if return_lse else result


def attention_backward(q, k, v, out, lse, dout, *, ranks=1, strategy="ring", layout="zigzag",
                       mask="none", document_ids=None, positions=None, ulysses_degree=0,
                       head_groups=0, threads=1, scale=None, bf16_tier="exact"):
    """Gradients (dq, dk, dv) of attention, given the forward's out and lse and the output
    gradient dout [B, T, Hq, D]. Same options as attention(); results in q's dtype. lse must be
    finite, or -inf for a row that sees no key (NaN / +inf is refused, naming the entry)."""
    ranks = _checks.ranks(ranks)
    t = Tensors({"q": q, "k": k, "v": v, "out": out, "dout": dout, "lse": lse}, rows=("lse",))
    check_attention_shapes(t["q"], t["k"], t["v"])
    B, T, Hq, D = t["q"].shape
    check_same_shape("out", t["out"], (B, T, Hq, D), "q's [B, T, Hq, D]")
    check_same_shape("dout", t["dout"], (B, T, Hq, D), "q's [B, T, Hq, D]")
    check_same_shape("lse", t["lse"], (B, Hq, T), "[B, Hq, T]")
    check_lse(t["lse"])
    dq, dk, dv = t.empty(t["q"].shape), t.empty(t["k"].shape), t.empty(t["v"].shape)
    args = job_args(strategy, layout, mask, document_ids, positions, ulysses_degree, head_groups,
                    threads, scale, bf16_tier)
    if t.cuda_index >= 0:
        _on_cuda_ranks(t, ranks, layout, args,
                       [(t[n], 2 if n == "lse" else 1)
                        for n in ("q", "k", "v", "out", "lse", "dout")],
                       [(dq, 1), (dk, 1), (dv, 1)])
    else:
        _ctxpar._backward(t["q"], t["k"], t["v"], t["out"], t["lse"], t["dout"], dq, dk, dv,
                          ranks, args)
    return t.restore(dq), t.restore(dk), t.restore(dv)

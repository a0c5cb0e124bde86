"""Whole-tensor attention: [B, T, H, D] in, [B, T, H, D] out; P ranks run as threads of this
process (shard by the layout, run the strategy, unshard)."""
from . import _ctxpar
from . import _checks
from ._arrays import (Tensors, check_attention_shapes, check_lse, check_same_shape,
                      check_writable_out, int_array)


def _slice_of(i, s):
    """One slice, {"q": [s, e], "k": [s, e], "type": "full" | "causal"} or the tuple
    (q_range, k_range, type) of MagiAttention's AttnSlice, as the JSON object the mask reads."""
    if isinstance(s, dict):
        unknown = set(s) - {"q", "k", "type"}
        if unknown:
            raise ValueError(f"mask: slice {i} has unknown keys {sorted(unknown)}; expected "
                             f"'q', 'k', 'type'")
        q, k, kind = s.get("q"), s.get("k"), s.get("type")
    elif isinstance(s, (tuple, list)) and len(s) == 3:
        q, k, kind = s
    else:
        raise ValueError(f"mask: slice {i} must be {{'q': [start, end], 'k': [start, end], "
                         f"'type': 'full' | 'causal'}} or (q_range, k_range, type), got {s!r}")
    ranges = []
    for name, r in (("q", q), ("k", k)):
        if not isinstance(r, (tuple, list)) or len(r) != 2:
            raise ValueError(f"mask: slice {i}: {name} must be [start, end], got {r!r}")
        ranges.append([_checks.whole(f"mask slice {i} {name}", x, 0, 1 << 62) for x in r])
    if kind not in ("full", "causal"):
        raise ValueError(f"mask: slice {i}: type must be 'full' or 'causal', got {kind!r}")
    return {"q": ranges[0], "k": ranges[1], "type": kind}


def mask_text(mask):
    """"none" | "causal" | ("window", L, R) | any text of the CLI's --mask ("causal+window:L,R",
    "prefix-tree:P,R1,...") | a list of slices ({"q": [s, e], "k": [s, e], "type": "full" |
    "causal"} or (q_range, k_range, type)): the union of the slices (docs/kernel.md, "Slice
    masks")."""
    if isinstance(mask, str):
        return mask
    if isinstance(mask, (tuple, list)) and len(mask) == 3 and mask[0] in ("window",
                                                                         "causal+window"):
        kind, left, right = mask
        left = _checks.whole("mask", left, -(1 << 62), 1 << 62)
        right = _checks.whole("mask", right, -(1 << 62), 1 << 62)
        return f"{kind}:{left},{right}"
    if isinstance(mask, (tuple, list)) and len(mask) > 0 and not isinstance(mask[0], str):
        import json
        return "slices:" + json.dumps([_slice_of(i, s) for i, s in enumerate(mask)],
                                      separators=(",", ":"))
    raise ValueError(f"mask: expected 'none', 'causal', ('window', L, R), a mask text such as "
                     f"'causal+window:L,R', or a list of slices, got {mask!r}")


def document_ids_from_cu_seqlens(cu_seqlens):
    """The document id of each token (int32) from flash_attn_varlen_func's cu_seqlens: the
    cumulative lengths [0, l0, l0 + l1, ..., T] of the packed documents."""
    import numpy as np
    cu = cu_seqlens
    if hasattr(cu, "detach"):
        cu = cu.detach().cpu().numpy()
    cu = np.asarray(cu)
    if cu.ndim != 1 or cu.size < 2 or cu.dtype.kind not in "iu":
        raise ValueError(f"cu_seqlens: expected a 1-D integer array [0, l0, l0 + l1, ..., T] of at "
                         f"least two entries, got shape {cu.shape} dtype {cu.dtype}")
    if cu[0] != 0 or np.any(np.diff(cu) <= 0):
        raise ValueError("cu_seqlens: must start at 0 and increase strictly (every document at "
                         "least one token), as flash_attn_varlen_func's")
    if cu.size - 1 > (1 << 31) - 1:
        raise ValueError(f"cu_seqlens: {cu.size - 1} documents, over 2^31 - 1")
    return np.repeat(np.arange(cu.size - 1, dtype=np.int32), np.diff(cu).astype(np.int64))


def documents(document_ids, cu_seqlens):
    """The document ids (int32 [T], or None) of document_ids= or cu_seqlens= (one of them)."""
    if cu_seqlens is not None:
        if document_ids is not None:
            raise ValueError("cu_seqlens: pass cu_seqlens or document_ids, not both")
        document_ids = document_ids_from_cu_seqlens(cu_seqlens)
    return int_array(document_ids, "document_ids", "int32")


def options(strategy="ring", layout="zigzag", mask="none", document_ids=None, positions=None,
            ulysses_degree=0, head_groups=0, threads=1, scale=None, bf16_tier="exact",
            cu_seqlens=None):
    """The options every entry point shares, checked (ctxpar._checks), by the names of
    _ctxpar._JobArgs."""
    return dict(strategy=_checks.choice("strategy", strategy, _checks.STRATEGIES),
                layout=_checks.choice("layout", layout, _checks.LAYOUTS), mask=mask_text(mask),
                positions=int_array(positions, "positions", "int64"),
                documents=documents(document_ids, cu_seqlens),
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
    if layout == "balanced":
        raise ValueError("layout: 'balanced' is not taken for CUDA tensors yet (the cuda device "
                         "has not run on a GPU: docs/cuda.md); use zigzag or striped")
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
              head_groups=0, threads=1, scale=None, bf16_tier="exact", cu_seqlens=None):
    """Exact attention of whole tensors, computed by `ranks` ranks (threads) with `strategy`.

    q [B, T, Hq, D]; k, v [B, T, Hkv, D] (Hq % Hkv == 0): NumPy arrays or torch tensors (CPU, or
    all on one GPU: docs/python.md, "CUDA tensors"), float32 / bfloat16 / float16 (float16 is widened to float32 and the result narrowed back).
    mask: "none" | "causal" | ("window", L, R) | "causal+window:L,R" | "prefix-tree:P,R1,..." |
    a list of slices (any block mask, docs/kernel.md "Slice masks"); document_ids (T ints), or
    cu_seqlens as flash_attn_varlen_func's, adds the documents rule (attention only inside a
    document); layout "balanced" balances the mask's work over the ranks; positions (T ints) replaces the
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
                    threads, scale, bf16_tier, cu_seqlens)
    if t.cuda_index >= 0:
        _on_cuda_ranks(t, ranks, layout, args, [(t[n], 1) for n in ("q", "k", "v")],
                       [(result, 1), (lse, 2)])
    else:
        _ctxpar._forward(t["q"], t["k"], t["v"], result, lse, ranks, args)
    result = out if out is not None else t.restore(result)
    return (result, lse) if return_lse else result


def attention_backward(q, k, v, out, lse, dout, *, ranks=1, strategy="ring", layout="zigzag",
                       mask="none", document_ids=None, positions=None, ulysses_degree=0,
                       head_groups=0, threads=1, scale=None, bf16_tier="exact", cu_seqlens=None):
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
                    threads, scale, bf16_tier, cu_seqlens)
    if t.cuda_index >= 0:
        _on_cuda_ranks(t, ranks, layout, args,
                       [(t[n], 2 if n == "lse" else 1)
                        for n in ("q", "k", "v", "out", "lse", "dout")],
                       [(dq, 1), (dk, 1), (dv, 1)])
    else:
        _ctxpar._backward(t["q"], t["k"], t["v"], t["out"], t["lse"], t["dout"], dq, dk, dv,
                          ranks, args)
    return t.restore(dq), t.restore(dk), t.restore(dv)

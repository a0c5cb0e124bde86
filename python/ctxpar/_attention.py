"""Whole-tensor attention: [B, T, H, D] in, [B, T, H, D] out; P ranks run as threads of this
process (shard by the layout, run the strategy, unshard)."""
from . import _ctxpar
from ._arrays import (Tensors, check_attention_shapes, check_same_shape, int_array)


def mask_text(mask):
    """"none" | "causal" | ("window", L, R) | any text of the CLI's --mask ("causal+window:L,R")."""
    if isinstance(mask, str):
        return mask
    if isinstance(mask, (tuple, list)) and len(mask) == 3 and mask[0] in ("window",
                                                                         "causal+window"):
        kind, left, right = mask
        return f"{kind}:{int(left)},{int(right)}"
    raise ValueError(f"mask: expected 'none', 'causal', ('window', L, R) or a mask text such as "
                     f"'causal+window:L,R', got {mask!r}")


def job_args(strategy="ring", layout="zigzag", mask="none", document_ids=None, positions=None,
             ulysses_degree=0, head_groups=0, threads=1, scale=None):
    return _ctxpar._JobArgs(strategy, layout, mask_text(mask),
                            int_array(positions, "positions", "int64"),
                            int_array(document_ids, "document_ids", "int32"),
                            int(ulysses_degree), int(head_groups), int(threads),
                            float(scale or 0.0))


def attention(q, k, v, *, ranks=1, strategy="ring", layout="zigzag", mask="none",
              document_ids=None, positions=None, return_lse=True, out=None, ulysses_degree=0,
              head_groups=0, threads=1, scale=None):
    """Exact attention of whole tensors, computed by `ranks` ranks (threads) with `strategy`.

    q [B, T, Hq, D]; k, v [B, T, Hkv, D] (Hq % Hkv == 0): NumPy arrays or CPU torch tensors,
    float32 / bfloat16 / float16 (float16 is widened to float32 and the result narrowed back).
    mask: "none" | "causal" | ("window", L, R) | "causal+window:L,R" ...; document_ids (T ints)
    adds the documents rule (attention only inside a document); positions (T ints) replaces the
    global positions 0..T-1 the mask reads. Returns (out [B, T, Hq, D], lse [B, Hq, T] float32),
    or out alone with return_lse=False. `out` may be given (written in place, returned as is).
    """
    t = Tensors({"q": q, "k": k, "v": v})
    check_attention_shapes(t["q"], t["k"], t["v"])
    B, T, Hq, D = t["q"].shape
    if out is not None:
        if t.converted:
            raise TypeError("out: not supported with float16 inputs (the result is converted)")
        Tensors({"q": q, "out": out})
        if t.kind == "numpy" and not out.flags.writeable:
            raise ValueError("out: the array is read-only")
        check_same_shape("out", out, (B, T, Hq, D), "q's [B, T, Hq, D]")
        result = out.detach() if t.kind == "torch" else out
    else:
        result = t.empty((B, T, Hq, D))
    lse = t.empty((B, Hq, T), like_dtype=False)
    args = job_args(strategy, layout, mask, document_ids, positions, ulysses_degree, head_groups,
                    threads, scale)
    _ctxpar._forward(t["q"], t["k"], t["v"], result, lse, int(ranks), args)
    result = out if out is not None else t.restore(result)
    return (result, lse) if return_lse else result


def attention_backward(q, k, v, out, lse, dout, *, ranks=1, strategy="ring", layout="zigzag",
                       mask="none", document_ids=None, positions=None, ulysses_degree=0,
                       head_groups=0, threads=1, scale=None):
    """Gradients (dq, dk, dv) of attention, given the forward's out and lse and the output
    gradient dout [B, T, Hq, D]. Same options as attention(); results in q's dtype."""
    t = Tensors({"q": q, "k": k, "v": v, "out": out, "dout": dout, "lse": lse}, rows=("lse",))
    check_attention_shapes(t["q"], t["k"], t["v"])
    B, T, Hq, D = t["q"].shape
    check_same_shape("out", t["out"], (B, T, Hq, D), "q's [B, T, Hq, D]")
    check_same_shape("dout", t["dout"], (B, T, Hq, D), "q's [B, T, Hq, D]")
    check_same_shape("lse", t["lse"], (B, Hq, T), "[B, Hq, T]")
    dq, dk, dv = t.empty(t["q"].shape), t.empty(t["k"].shape), t.empty(t["v"].shape)
    args = job_args(strategy, layout, mask, document_ids, positions, ulysses_degree, head_groups,
                    threads, scale)
    _ctxpar._backward(t["q"], t["k"], t["v"], t["out"], t["lse"], t["dout"], dq, dk, dv,
                      int(ranks), args)
    return t.restore(dq), t.restore(dk), t.restore(dv)

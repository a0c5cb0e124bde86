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
            ulysses_degree=0, head_groups=0, threads=1, scale=None):
    """The options every entry point shares, checked (ctxpar._checks), by the names of
    _ctxpar._JobArgs."""
    return dict(strategy=_checks.choice("strategy", strategy, _checks.STRATEGIES),
                layout=_checks.choice("layout", layout, _checks.LAYOUTS), mask=mask_text(mask),
                positions=int_array(positions, "positions", "int64"),
                documents=int_array(document_ids, "document_ids", "int32"),
                ulysses_degree=_checks.whole("ulysses_degree", ulysses_degree, 0,
                                             _checks.MAX_PROCESSES),
                head_groups=_checks.whole("head_groups", head_groups, 0, _checks.MAX_HEADS),
                threads=_checks.threads(threads), scale=_checks.scale(scale))


def job_args(*args, **kwargs):
    """options(...) packed for C++."""
    return _ctxpar._JobArgs(**options(*args, **kwargs))


def attention(q, k, v, *, ranks=1, strategy="ring", layout="zigzag", mask="none",
              document_ids=None, positions=None, return_lse=True, out=None, ulysses_degree=0,
              head_groups=0, threads=1, scale=None):
    """Exact attention of whole tensors, computed by `ranks` ranks (threads) with `strategy`.

    q [B, T, Hq, D]; k, v [B, T, Hkv, D] (Hq % Hkv == 0): NumPy arrays or CPU torch tensors,
    float32 / bfloat16 / float16 (float16 is widened to float32 and the result narrowed back).
    mask: "none" | "causal" | ("window", L, R) | "causal+window:L,R" ...; document_ids (T ints)
    adds the documents rule (attention only inside a document); positions (T ints) replaces the
    global positions 0..T-1 the mask reads. Returns (out [B, T, Hq, D], lse [B, Hq, T] float32),
    or out alone with return_lse=False. `out` may be given (written in place, returned as is;
    writable, no two elements sharing memory). scale: None (1/sqrt(D)) or a positive finite
    number. Every number is range-checked as the command's options (docs/python.md, "Argument
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
                    threads, scale)
    _ctxpar._forward(t["q"], t["k"], t["v"], result, lse, ranks, args)
    result = out if out is not None else t.restore(result)
    return (result, lse) if return_lse else result


def attention_backward(q, k, v, out, lse, dout, *, ranks=1, strategy="ring", layout="zigzag",
                       mask="none", document_ids=None, positions=None, ulysses_degree=0,
                       head_groups=0, threads=1, scale=None):
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
                    threads, scale)
    _ctxpar._backward(t["q"], t["k"], t["v"], t["out"], t["lse"], t["dout"], dq, dk, dv,
                      ranks, args)
    return t.restore(dq), t.restore(dk), t.restore(dv)

"""One rank's attention for ctxpar.torch.cp_attention: eagerly, an autograd Function; under
torch.compile, the ops ctxpar::cp_attention and ctxpar::cp_attention_backward (Note
[cp_attention under torch.compile])."""
import threading

import torch

from . import _ctxpar
from ._agreement import agree, digest
from ._arrays import Tensors, check_attention_shapes, route_cuda, sync_cuda
from ._attention import options


def _run_forward(comm, args, q, k, v):
    """The strategy's forward on one rank's shard: (out, lse, cuda_index)."""
    t = Tensors({"q": q, "k": k, "v": v})
    check_attention_shapes(q, k, v)
    B, Tl, Hq, _ = q.shape
    out = t.empty(q.shape)
    lse = t.empty((B, Hq, Tl), like_dtype=False)
    _ctxpar._local_forward(comm, t["q"], t["k"], t["v"], out, lse, args, t.launch())
    return out, lse, t.cuda_index


def _run_backward(comm, args, q, k, v, out, lse, dout, cuda_index):
    """The strategy's backward (collective: every rank runs it): (dq, dk, dv)."""
    # Upstream gradients may be broadcast views (stride 0) or of another dtype.
    dout = dout.to(out.dtype)
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if cuda_index >= 0:  # dq, dk, dv on q's GPU; dout's device is checked in C++
        sync_cuda(dq)
    _ctxpar._local_backward(comm, q.detach(), k.detach(), v.detach(), out, lse, dout.detach(),
                            dq, dk, dv, args, cuda_index)
    return dq, dk, dv


class _CPAttention(torch.autograd.Function):
    """One rank's attention over the distributed sequence, run eagerly; backward is the
    strategy's (collective too: every rank must run backward)."""

    @staticmethod
    def forward(ctx, q, k, v, comm, args):
        out, lse, cuda_index = _run_forward(comm, args, q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.comm, ctx.args, ctx.cuda_index = comm, args, cuda_index
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _run_backward(ctx.comm, ctx.args, q, k, v, out, lse, dout, ctx.cuda_index)
        return dq, dk, dv, None, None


# Note [cp_attention under torch.compile]
# Dynamo cannot trace the communication (a C++ call that blocks on other ranks) nor the DLPack
# exchange, so under torch.compile the attention is one opaque op, ctxpar::cp_attention (and
# ctxpar::cp_attention_backward), with fake implementations for the shapes and an autograd
# formula: the graph goes around it, unbroken, in every backend. An op's arguments are tensors
# and plain values; the communicator is neither. It travels as a handle, an int key into
# _ROUTES, which holds (comm, the C++ job arguments, the fields the ranks agree on). The handle is
# made while Dynamo traces (_compiled_route, torch.compiler.assume_constant_result): the options
# are checked then, once per compiled graph, and the int is a constant of the graph; Dynamo
# guards on the communicator and the options, so another of either recompiles (a new handle)
# rather than reusing a stale one. An int rather than a string: the key names the communicator
# object itself, which no text can. The forward op runs the ranks' agreement on every call, as
# the eager path does. A handle keeps its communicator referenced for the process's life (a
# nanobind object cannot be weakly referenced); only compiled code makes handles, so eager calls
# leave a communicator's lifetime to its owner. Options that are arrays (document_ids,
# positions) would be baked into the graph as constants and reused for the next batch's
# documents, silently wrong: with them cp_attention runs eagerly (one graph break, named).
_ROUTES = {}
_ROUTE_KEYS = {}
_ROUTES_LOCK = threading.Lock()
# torch.library.custom_op and torch.compiler arrived in torch 2.4 / 2.1: before them nothing
# compiles, and cp_attention is the eager autograd Function alone.
_CAN_COMPILE = (hasattr(torch.library, "custom_op")
                and hasattr(getattr(torch, "compiler", None), "assume_constant_result"))


def _compiling():
    return _CAN_COMPILE and torch.compiler.is_compiling()


def _agreement(o):
    """The fields of options `o` every rank must share (threads is left out, as the command
    leaves out --threads: it changes no answer)."""
    return [("strategy", o["strategy"]), ("layout", o["layout"]), ("mask", o["mask"]),
            ("scale", "None (1/sqrt(D))" if o["scale"] == 0.0 else repr(o["scale"])),
            ("bf16_tier", o["bf16_tier"]),
            ("ulysses_degree", str(o["ulysses_degree"])), ("head_groups", str(o["head_groups"])),
            ("positions", digest(o["positions"])), ("document_ids", digest(o["documents"]))]


if _CAN_COMPILE:
    @torch.compiler.assume_constant_result
    def _compiled_route(comm, strategy, layout, mask, ulysses_degree, head_groups, threads, scale,
                        bf16_tier):
        """The handle of (comm, options) for the ctxpar ops (Note [cp_attention under
        torch.compile]); the same for the same pair, so a retrace makes the same graph."""
        o = options(strategy, layout, mask, None, None, ulysses_degree, head_groups, threads, scale,
                    bf16_tier)
        fields = _agreement(o)
        key = (id(comm), tuple(fields), o["threads"])
        with _ROUTES_LOCK:
            handle = _ROUTE_KEYS.get(key)
            if handle is None:
                handle = len(_ROUTES)
                _ROUTES[handle] = (comm, _ctxpar._JobArgs(**o), fields)
                _ROUTE_KEYS[key] = handle
        return handle

    def _route(handle):
        with _ROUTES_LOCK:
            route = _ROUTES.get(handle)
        if route is None:
            raise ValueError(f"route: {handle} is no handle of ctxpar's (they come from "
                             "ctxpar.torch.cp_attention under torch.compile); call cp_attention")
        return route

    @torch.library.custom_op("ctxpar::cp_attention", mutates_args=())
    def _op_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    route: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cp_attention's forward as one op for torch.compile: (out [B, Tl, Hq, D],
        lse [B, Hq, Tl])."""
        comm, args, fields = _route(route)
        agree(comm, "cp_attention", fields)
        out, lse, _ = _run_forward(comm, args, q, k, v)
        return out, lse

    @_op_forward.register_fake
    def _op_forward_fake(q, k, v, route):
        check_attention_shapes(q, k, v)
        B, Tl, Hq, _ = q.shape
        dtype = torch.bfloat16 if q.dtype == torch.bfloat16 else torch.float32
        return q.new_empty(q.shape, dtype=dtype), q.new_empty((B, Hq, Tl), dtype=torch.float32)

    @torch.library.custom_op("ctxpar::cp_attention_backward", mutates_args=())
    def _op_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                     lse: torch.Tensor, dout: torch.Tensor,
                     route: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """cp_attention's backward as one op: (dq, dk, dv)."""
        comm, args, _ = _route(route)
        return _run_backward(comm, args, q, k, v, out, lse, dout, route_cuda({"q": q}))

    @_op_backward.register_fake
    def _op_backward_fake(q, k, v, out, lse, dout, route):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def _op_setup_context(ctx, inputs, output):
        q, k, v, route = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.route = route
        ctx.mark_non_differentiable(lse)

    def _op_backward_formula(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = torch.ops.ctxpar.cp_attention_backward(q, k, v, out, lse, dout, ctx.route)
        return dq, dk, dv, None

    _op_forward.register_autograd(_op_backward_formula, setup_context=_op_setup_context)


def _no_compile(what):
    """A decorator: the function runs eagerly under torch.compile. Dynamo breaks the graph at it,
    with a reason that names `what` (fullgraph=True stops there), instead of tracing into the
    communication and the DLPack exchange (Dynamo cannot build a constant of a DLDeviceType)."""
    def wrap(fn):
        disable = getattr(getattr(torch, "compiler", None), "disable", None)
        if disable is None:  # torch < 2.1: nothing compiles
            return fn
        reason = (f"ctxpar's {what} eagerly (its communication is not traceable): the "
                  "compiled function breaks its graph there; with fullgraph=True compile the "
                  "parts around the attention instead")
        try:
            return disable(fn, reason=reason)
        except TypeError:  # a torch.compiler.disable without reason=
            return disable(fn)
    return wrap


def _eager(q, k, v, comm, *opts):
    """cp_attention on the autograd Function (opts: options()'s), the ranks' agreement first."""
    o = options(*opts)
    agree(comm, "cp_attention", _agreement(o))
    return _CPAttention.apply(q, k, v, comm, _ctxpar._JobArgs(**o))


# document_ids / positions are arrays a compiled graph would keep as constants for the next
# batch (Note [cp_attention under torch.compile]).
_eager_with_arrays = _no_compile("cp_attention with document_ids or positions runs")(_eager)

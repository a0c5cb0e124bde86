"""PyTorch on one rank's shard: a differentiable cp_attention and the context_parallel block of
torch.distributed.tensor.experimental (the seeds' API), on a ctxpar.Communicator or (the
block) a torch DeviceMesh.

    out_local = cp_attention(q_local, k_local, v_local, comm=comm, layout="zigzag", causal=True)

    with context_parallel(comm, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)   # [B, H, Tl, D]

Local tensors are [B, Tl, H, D] (cp_attention) and hold this rank's tokens in layout order
(ctxpar.layout.shard). See docs/python.md.
"""
import contextlib

import torch
import torch.nn.functional as F

from . import _ctxpar
from . import _checks
from . import layout as _layout
from ._agreement import agree, digest
from ._arrays import Tensors, check_attention_shapes, sync_cuda
from ._attention import options


class _CPAttention(torch.autograd.Function):
    """One rank's attention over the distributed sequence; backward is the strategy's
    (collective too: every rank must run backward)."""

    @staticmethod
    def forward(ctx, q, k, v, comm, args):
        t = Tensors({"q": q, "k": k, "v": v})
        check_attention_shapes(q, k, v)
        B, Tl, Hq, _ = q.shape
        out = t.empty(q.shape)
        lse = t.empty((B, Hq, Tl), like_dtype=False)
        _ctxpar._local_forward(comm, t["q"], t["k"], t["v"], out, lse, args, t.launch())
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.comm, ctx.args, ctx.cuda_index = comm, args, t.cuda_index
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        # Upstream gradients may be broadcast views (stride 0) or of another dtype.
        dout = dout.to(out.dtype)
        if dout.stride(-1) != 1:
            dout = dout.contiguous()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        if ctx.cuda_index >= 0:  # dq, dk, dv on q's GPU; dout's device is checked in C++
            sync_cuda(dq)
        _ctxpar._local_backward(ctx.comm, q.detach(), k.detach(), v.detach(), out, lse,
                                dout.detach(), dq, dk, dv, ctx.args, ctx.cuda_index)
        return dq, dk, dv, None, None


def cp_attention(q_local, k_local, v_local, comm, layout="zigzag", causal=False, *, mask=None,
                 strategy="ring", document_ids=None, positions=None, return_lse=False,
                 ulysses_degree=0, head_groups=0, threads=1, scale=None, bf16_tier="exact"):
    """Exact attention of this rank's queries over the whole distributed sequence.

    q_local [B, Tl, Hq, D], k_local / v_local [B, Tl, Hkv, D]: this rank's tokens in `layout`
    order; every rank of `comm` calls it (and later backward) with the same options.
    mask overrides causal ("none" | "causal" | ("window", L, R) | mask text); document_ids and
    positions describe the whole sequence (T = Tl * comm.size entries). float16 is computed in
    float32 (differentiable casts). bf16_tier: "exact" or "fast" (bfloat16 inputs: P and dS
    rounded to bfloat16, as GPU flash attention; docs/kernel.md, "bf16 tiers"). Returns out_local [B, Tl, Hq, D] (and lse [B, Hq, Tl])."""
    if not isinstance(comm, _ctxpar.Communicator):
        raise TypeError(f"comm: expected a ctxpar.Communicator, got {type(comm).__name__}")
    mask = mask if mask is not None else ("causal" if causal else "none")
    o = options(strategy, layout, mask, document_ids, positions, ulysses_degree, head_groups,
                threads, scale, bf16_tier)
    # threads is left out, as the command leaves out --threads: it changes no answer.
    agree(comm, "cp_attention", [
        ("strategy", o["strategy"]), ("layout", o["layout"]), ("mask", o["mask"]),
        ("scale", "None (1/sqrt(D))" if o["scale"] == 0.0 else repr(o["scale"])),
        ("bf16_tier", o["bf16_tier"]),
        ("ulysses_degree", str(o["ulysses_degree"])), ("head_groups", str(o["head_groups"])),
        ("positions", digest(o["positions"])), ("document_ids", digest(o["documents"]))])
    args = _ctxpar._JobArgs(**o)
    half = [x.dtype == torch.float16 for x in (q_local, k_local, v_local)
            if isinstance(x, torch.Tensor)]
    if half and all(half):
        q_local, k_local, v_local = q_local.float(), k_local.float(), v_local.float()
    out, lse = _CPAttention.apply(q_local, k_local, v_local, comm, args)
    if half and all(half):
        out = out.half()
    return (out, lse) if return_lse else out


class _RouteAttention(torch.overrides.TorchFunctionMode):
    """Inside a context_parallel block, torch's scaled_dot_product_attention runs on ctxpar,
    however the caller reached it (F.scaled_dot_product_attention, a name bound by
    `from torch.nn.functional import scaled_dot_product_attention` before the block, or
    torch._C._nn's): a TorchFunctionMode sees the call itself, not the name. Modes are per
    thread, so ranks that run as threads are each routed through their own block."""

    def __init__(self, comm, layout, strategy, threads, bf16_tier):
        super().__init__()
        self.route = (comm, layout, strategy, threads, bf16_tier)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SDPA:
            return _scaled_dot_product_attention(self.route, *args, **kwargs)
        return func(*args, **kwargs)


_SDPA = getattr(F, "scaled_dot_product_attention", None)  # None before torch 2.0


def _scaled_dot_product_attention(route, query, key, value, attn_mask=None, dropout_p=0.0,
                                  is_causal=False, scale=None, enable_gqa=False):
    """F.scaled_dot_product_attention's signature ([B, H, Tl, D]) on cp_attention."""
    comm, layout, strategy, threads, bf16_tier = route
    if attn_mask is not None:
        raise ValueError("attn_mask: not supported inside ctxpar's context_parallel (masks come "
                         "from global positions); use is_causal=True, or "
                         "ctxpar.torch.cp_attention(mask=...)")
    if dropout_p != 0.0:
        raise ValueError(f"dropout_p: ctxpar computes exact attention; got {dropout_p}")
    # [B, H, Tl, D] -> [B, Tl, H, D]: a strided view, no copy (last dim stays contiguous).
    out = cp_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), comm,
                       layout=layout, causal=is_causal, strategy=strategy, threads=threads,
                       scale=scale, bf16_tier=bf16_tier)
    return out.transpose(1, 2)


def _check_buffers(comm, buffers, dims, layout):
    """Buffers are torch tensors whose seq dims hold one sequence length, which the layout can
    cut into comm.size equal shards. Returns the dims made non-negative."""
    if len(buffers) != len(dims):
        raise ValueError(f"buffer_seq_dims: {len(dims)} entries for {len(buffers)} buffers")
    for i, b in enumerate(buffers):
        if not isinstance(b, torch.Tensor):
            raise TypeError(f"buffers[{i}]: expected a torch tensor, got {type(b).__name__}")
    dims = [_checks.whole(f"buffer_seq_dims[{i}]", d, -max(b.ndim, 1), max(b.ndim, 1) - 1)
            % max(b.ndim, 1) for i, (b, d) in enumerate(zip(buffers, dims))]
    if not buffers:
        return dims
    T = buffers[0].shape[dims[0]]
    for i, (b, d) in enumerate(zip(buffers, dims)):
        if b.shape[d] != T:
            raise ValueError(
                f"buffer_seq_dims[{i}]: buffers[{i}] has {b.shape[d]} tokens along dim {d} "
                f"(shape {tuple(b.shape)}) but buffers[0] has {T} along dim {dims[0]} (shape "
                f"{tuple(buffers[0].shape)}); every buffer's seq dim must hold the same sequence "
                "(is the dim right?)")
    P = comm.size
    unit = _ctxpar._layout_granule(layout, P)
    if T % unit != 0:
        raise ValueError(f"buffers: the sequence of {T} tokens (buffers[0] dim {dims[0]}) cannot be "
                         f"cut into {P} equal shards by the {layout} layout (it needs T % {unit} "
                         "== 0); pad the sequence")
    return dims


@contextlib.contextmanager
def context_parallel(mesh, buffers=(), buffer_seq_dims=(), no_restore_buffers=None,
                     layout="zigzag", strategy="ring", threads=1, bf16_tier="exact"):
    """Shards `buffers` in place along `buffer_seq_dims` (this rank's tokens in `layout`
    order) and, inside the block, runs torch's scaled_dot_product_attention on ctxpar (by a
    TorchFunctionMode: names bound before the block are routed too). `mesh` is a 1-D torch
    DeviceMesh (e.g. mesh["cp"], torch's own signature) or a ctxpar.Communicator. On exit,
    even by an exception, every buffer not in no_restore_buffers gets its full contents back.
    A restored buffer's .grad comes back whole too: the shard gradients of a backward inside
    the block are gathered from every rank (collective) into the full shape and added to the
    gradient it held before the block (on an exception the block's shard gradient is dropped).
    bf16_tier: cp_attention's ("exact" or "fast"). Needs torch >= 2.0
    (scaled_dot_product_attention)."""
    comm = _communicator(mesh)
    if _SDPA is None:
        raise RuntimeError(f"context_parallel: torch {torch.__version__} has no "
                           "scaled_dot_product_attention to route (torch >= 2.0 has); call "
                           "ctxpar.torch.cp_attention on the shards instead")
    layout = _checks.choice("layout", layout, _checks.LAYOUTS)
    strategy = _checks.choice("strategy", strategy, _checks.STRATEGIES)
    threads = _checks.threads(threads)
    bf16_tier = _checks.bf16_tier(bf16_tier)
    buffers = list(buffers)
    dims = _check_buffers(comm, buffers, list(buffer_seq_dims), layout)
    keep = {id(b) for b in (no_restore_buffers or ())}
    originals = [b.data for b in buffers]
    shards = [_layout.shard(b.data, comm, layout=layout, seq_dim=d) for b, d in zip(buffers, dims)]
    # Gradients from before the block (full shape) wait here; the block's start at None.
    grads_before = [b.grad if id(b) not in keep else None for b in buffers]
    ok = False
    try:
        for b, s, g in zip(buffers, shards, grads_before):
            if g is not None:
                b.grad = None
            b.data = s  # in place: the caller's tensor object now holds its shard
        with _RouteAttention(comm, layout, strategy, threads, bf16_tier):
            yield
        ok = True
    finally:
        block_grads = []
        for b, full, before in zip(buffers, originals, grads_before):
            if id(b) in keep:
                block_grads.append(None)
                continue
            block_grads.append(b.grad)
            b.grad = None
            b.data = full
            b.grad = before
        # Every tensor is whole again before the (collective) gathers, which may raise.
        for b, g, d, before in zip(buffers, block_grads, dims, grads_before):
            if ok and g is not None:
                whole = _layout.unshard(g, comm, layout=layout, seq_dim=d)
                b.grad = whole if before is None else before + whole


def _communicator(mesh):
    """context_parallel's first argument as a ctxpar.Communicator."""
    if isinstance(mesh, _ctxpar.Communicator):
        return mesh
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # torch < 2.2, or built without distributed
        DeviceMesh = ()
    if isinstance(mesh, DeviceMesh):
        from ._distributed import from_mesh
        return from_mesh(mesh)
    raise TypeError(f"mesh: expected a torch DeviceMesh (1-D, e.g. mesh['cp']) or a "
                    f"ctxpar.Communicator, got {type(mesh).__name__}")

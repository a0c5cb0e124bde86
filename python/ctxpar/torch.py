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
import inspect
import sys
import threading

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from . import _ctxpar
from . import _checks
from . import _masks
from . import layout as _layout
from ._agreement import agree_after, digest
from ._attention import documents as _documents
from . import _torch_ops
from ._torch_ops import _compiling, _eager, _eager_with_arrays, _no_compile


def cp_attention(q_local, k_local, v_local, comm, layout="zigzag", causal=False, *, mask=None,
                 strategy="ring", document_ids=None, positions=None, return_lse=False,
                 ulysses_degree=0, head_groups=0, threads=1, scale=None, bf16_tier="exact"):
    """Exact attention of this rank's queries over the whole distributed sequence.

    q_local [B, Tl, Hq, D], k_local / v_local [B, Tl, Hkv, D]: this rank's tokens in `layout`
    order; every rank of `comm` calls it (and later backward) with the same options.
    mask overrides causal ("none" | "causal" | ("window", L, R) | mask text); document_ids and
    positions describe the whole sequence (T = Tl * comm.size entries). float16 is computed in
    float32 (differentiable casts). bf16_tier: "exact" or "fast" (bfloat16 inputs: P and dS
    rounded to bfloat16, as GPU flash attention; docs/kernel.md, "bf16 tiers"). Returns
    out_local [B, Tl, Hq, D] (and lse [B, Hq, Tl]). Under torch.compile it is the op
    ctxpar::cp_attention, no graph break (Note [cp_attention under torch.compile]), except with
    document_ids or positions (one break: they run eagerly)."""
    if not isinstance(comm, _ctxpar.Communicator):
        raise TypeError(f"comm: expected a ctxpar.Communicator, got {type(comm).__name__}")
    mask = mask if mask is not None else ("causal" if causal else "none")
    half = [x.dtype == torch.float16 for x in (q_local, k_local, v_local)
            if isinstance(x, torch.Tensor)]
    if half and all(half):
        q_local, k_local, v_local = q_local.float(), k_local.float(), v_local.float()
    opts = (strategy, layout, mask, document_ids, positions, ulysses_degree, head_groups,
            threads, scale, bf16_tier)
    if not _compiling():
        out, lse = _eager(q_local, k_local, v_local, comm, *opts)
    elif document_ids is None and positions is None:
        route = _torch_ops._compiled_route(comm, strategy, layout, mask, ulysses_degree,
                                           head_groups, threads, scale, bf16_tier)
        out, lse = torch.ops.ctxpar.cp_attention(q_local, k_local, v_local, route)
    else:
        out, lse = _eager_with_arrays(q_local, k_local, v_local, comm, *opts)
    if half and all(half):
        out = out.half()
    return (out, lse) if return_lse else out


# Note [Every attention of a block]
# A TorchFunctionMode's handler runs with the mode popped off the stack, so what the handler
# calls is not seen again: the SDPA inside F.multi_head_attention_forward (nn.MultiheadAttention,
# nn.TransformerEncoderLayer / DecoderLayer) ran torch's kernel on the shard. The handler
# therefore runs torch's Python functions with the mode back on the stack
# (torch.overrides.redispatch_function skips the one dispatch that brought the call here); C
# ops, and Tensor's Python methods (they call their C namesake: re-entering would loop), run as
# they are. With a mode on the stack has_torch_function is true, so the modules' fast paths
# (torch._native_multi_head_attention, torch._transformer_encoder_layer_fwd) are not taken;
# those ops, and SDPA's backend kernels, called directly are refused: they see one shard.
#
# torch.utils.checkpoint recomputes its function in backward, where no mode is active (autograd
# does not carry the mode stack into backward). A checkpoint begun inside the block has its
# frame on the stack when its SDPA is routed: its recompute function (CheckpointFunction's
# ctx.run_function with use_reentrant=True, the _CheckpointFrame's recompute_fn with
# use_reentrant=False) is wrapped to run under the same route. Checkpoints already running when
# the block began are not the block's (their recompute re-enters the block itself). A torch whose
# checkpoint keeps that function elsewhere gets a refusal, never an SDPA on the shard.
#
# torch.compile: the routed SDPA is torch.compiler.disable'd (the mode's handler reads frames
# and swaps checkpoint functions, which Dynamo cannot trace), so Dynamo breaks the graph there
# and runs it eagerly; the rest of a compiled function stays compiled. cp_attention called
# directly is one op instead (Note [cp_attention under torch.compile]).


class _RouteAttention(torch.overrides.TorchFunctionMode):
    """Inside a context_parallel block, torch's scaled_dot_product_attention runs on ctxpar,
    however the caller reached it (F.scaled_dot_product_attention, a name bound by
    `from torch.nn.functional import scaled_dot_product_attention` before the block, torch._C._nn's,
    torch.ops.aten's, or torch's own Python functions such as nn.MultiheadAttention's): a
    TorchFunctionMode sees the call itself, not the name (Note [Every attention of a block]).
    Modes are per thread, so ranks that run as threads are each routed through their own block.

    route: (comm, layout, strategy, threads, bf16_tier, document ids [T] or None, this rank's
    global token indices (the block's layout of its T tokens) or None without buffers);
    buffers: the block's (index, buffer, seq dim, shape before the block), whose dims the
    routed SDPA checks."""

    def __init__(self, route, buffers=()):
        super().__init__()
        self.route, self.buffers = route, buffers
        self.outer = _checkpoint_frames()  # checkpoints running before the block began

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _op_name(func)
        if func is _SDPA or name == "aten::scaled_dot_product_attention":
            return _routed_sdpa(self, *args, **kwargs)
        if name.split("::")[-1].startswith(_LOCAL_ATTENTION):
            raise RuntimeError(
                f"{name}: inside ctxpar's context_parallel this op would attend to this rank's "
                "shard only; call torch.nn.functional.scaled_dot_product_attention (routed to "
                "ctxpar) or ctxpar.torch.cp_attention")
        if name.split("::")[-1] == "flex_attention":
            raise RuntimeError(
                "flex_attention inside ctxpar's context_parallel would attend to this rank's "
                "shard only (ctxpar does not run score_mod / block_mask functions); call "
                "torch.nn.functional.scaled_dot_product_attention (routed to ctxpar), or "
                "ctxpar.torch.cp_attention with mask= (causal, windows, documents)")
        if func is _MHA:
            _check_multi_head_attention(args, kwargs)
        if inspect.isfunction(func) and func.__module__ != "torch._tensor":
            if _REDISPATCH is None:
                if func is _MHA:
                    raise RuntimeError(
                        f"nn.MultiheadAttention inside ctxpar's context_parallel: torch "
                        f"{torch.__version__} cannot route the attention inside it (no "
                        "torch.overrides.redispatch_function); call ctxpar.torch.cp_attention "
                        "on the projected q, k, v instead")
                return func(*args, **kwargs)
            with self:
                return _REDISPATCH(func, types, args, kwargs)
        return func(*args, **kwargs)

    def check_seq_dims(self, named):
        """A block buffer that reaches SDPA (itself or a view of it) must have been cut along
        the dim SDPA reads as the sequence, T of [B, H, T, D]."""
        for name, x in named:
            ptr = x.untyped_storage().data_ptr()
            for i, b, d, shape in self.buffers:
                if ptr == 0 or ptr != b.untyped_storage().data_ptr():
                    continue
                if x.shape[2] == b.shape[d] and (b.shape[d] == 1 or x.stride(2) == b.stride(d)):
                    continue
                held = [k for k in range(4)
                        if x.shape[k] == b.shape[d] and x.stride(k) == b.stride(d)]
                what = f"as its {_BHTD[held[0]]}" if held else "merged into other dims"
                tokens = [j for j in range(b.ndim)
                          if b.shape[j] == x.shape[2] and x.stride(2) == b.stride(j)]
                hint = (f"pass buffer_seq_dims[{i}] = {tokens[0]}, the dim of its tokens"
                        if tokens else "pass the dim of its tokens")
                raise ValueError(
                    f"buffer_seq_dims[{i}] = {d}: buffers[{i}] (shape {shape} before the block) "
                    f"was cut along dim {d}, which scaled_dot_product_attention's {name} holds "
                    f"{what} ([B, H, T, D]); attention's sequence is T; {hint}")

    def route_recomputes(self):
        """Checkpoints begun inside the block recompute under this route in backward (Note
        [Every attention of a block])."""
        fresh = [f for f in _checkpoint_frames() if not any(f is o for o in self.outer)]
        owners = [o for o in map(_recompute_owner, fresh) if o is not None]
        # One frame of torch.utils.checkpoint.checkpoint per call (a recompute's own frames, such
        # as use_reentrant=False's recompute_fn, are none) and one owner each.
        if len(owners) < sum(f.f_code.co_name == "checkpoint" for f in fresh):
            raise RuntimeError(
                "torch.utils.checkpoint inside ctxpar's context_parallel: this torch "
                f"({torch.__version__}) keeps the function it recomputes in backward where ctxpar "
                "cannot find it, and the recompute would attend to this rank's shard only; "
                "call ctxpar.torch.cp_attention inside the checkpointed function instead")
        for owner, attr in owners:
            fn = getattr(owner, attr)
            if not getattr(fn, "_ctxpar_routed", False):
                setattr(owner, attr, _routed_recompute(fn, self.route))


_SDPA = getattr(F, "scaled_dot_product_attention", None)  # None before torch 2.0
_MHA = getattr(F, "multi_head_attention_forward", None)
_MHA_SIGNATURE = inspect.signature(_MHA) if _MHA is not None else None
_REDISPATCH = getattr(torch.overrides, "redispatch_function", None)
_CHECKPOINT_FILE = torch.utils.checkpoint.__file__
# Name prefixes of the fused attention ops, which would take the shard for the sequence: the
# modules' fast paths and SDPA's backends (torch.X and torch.ops.aten.X alike).
_LOCAL_ATTENTION = ("_scaled_dot_product", "_native_multi_head_attention",
                    "_transformer_encoder_layer_fwd", "_triton_multi_head_attention",
                    "_triton_scaled_dot_attention", "_flash_attention_forward",
                    "_efficient_attention_forward", "_cudnn_attention_forward")
_BHTD = ("batch B (dim 0)", "heads H (dim 1)", "sequence T (dim 2)", "head dim D (dim 3)")


def _op_name(func):
    """'aten::x' for torch.ops.aten.x (packet or overload), else the function's __name__."""
    schema = getattr(func, "_schema", None)
    if schema is not None:
        return schema.name
    qualified = getattr(func, "_qualified_op_name", None)
    return qualified if isinstance(qualified, str) else str(getattr(func, "__name__", ""))


def _checkpoint_frames():
    """The frames of torch.utils.checkpoint on this thread's stack."""
    frames, f = [], sys._getframe(1)
    while f is not None:
        if f.f_code.co_filename == _CHECKPOINT_FILE:
            frames.append(f)
        f = f.f_back
    return frames


def _recompute_owner(frame):
    """(object, attribute) holding the function that the checkpoint running in `frame` calls
    again in backward, or None where this frame holds none."""
    local = frame.f_locals
    ctx = local.get("ctx")
    if frame.f_code.co_name == "forward" and callable(getattr(ctx, "run_function", None)):
        return ctx, "run_function"  # use_reentrant=True: CheckpointFunction.forward
    gen = local.get("gen")  # use_reentrant=False: the generator that made the _CheckpointFrame
    if inspect.isgenerator(gen) and gen.gi_frame is not None:
        local = gen.gi_frame.f_locals
    owner = local.get("new_frame")
    if callable(getattr(owner, "recompute_fn", None)):
        return owner, "recompute_fn"
    return None


def _routed_recompute(fn, route):
    """fn under `route`: a checkpoint's recompute in backward, outside any block."""
    def recompute(*args, **kwargs):
        with _RouteAttention(route):
            return fn(*args, **kwargs)
    recompute._ctxpar_routed = True
    return recompute


def _check_multi_head_attention(args, kwargs):
    """F.multi_head_attention_forward's options that context parallelism cannot compute."""
    a = _MHA_SIGNATURE.bind(*args, **kwargs)
    a.apply_defaults()
    a = a.arguments
    where = "nn.MultiheadAttention inside ctxpar's context_parallel"
    if a["need_weights"]:
        raise ValueError(f"need_weights=True: {where} cannot return the attention weights (no "
                         "rank holds a query's scores over the whole sequence, and torch "
                         "computes them without scaled_dot_product_attention, on the shard); "
                         "pass need_weights=False (nn.MultiheadAttention's default is True)")
    if a["key_padding_mask"] is not None:
        raise ValueError(f"key_padding_mask: not supported by {where} (masks come from global "
                         "positions); drop the padding, or call ctxpar.torch.cp_attention with "
                         "mask= / document_ids=")
    if a["attn_mask"] is not None and not a["is_causal"]:
        raise ValueError(f"attn_mask: not supported by {where} (masks come from global "
                         "positions); for causal attention pass is_causal=True (with attn_mask "
                         "the causal mask, as torch asks), or call ctxpar.torch.cp_attention "
                         "with mask=")
    # Each adds keys outside the sequence's positions, or replaces the keys of the shard.
    for option, fix in (("bias_k", "build the module with add_bias_kv=False"),
                        ("static_k", "pass static_k=None"), ("static_v", "pass static_v=None")):
        if a[option] is not None:
            raise ValueError(f"{option}: not supported by {where} (keys outside the sequence's "
                             f"positions); {fix}")
    if a["add_zero_attn"]:
        raise ValueError(f"add_zero_attn=True: not supported by {where} (a key outside the "
                         "sequence's positions); build the module with add_zero_attn=False")


@_no_compile("context_parallel runs scaled_dot_product_attention")
def _routed_sdpa(mode, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                 scale=None, enable_gqa=False):
    """F.scaled_dot_product_attention's signature ([B, H, Tl, D]) on cp_attention."""
    comm, layout, strategy, threads, bf16_tier, documents, positions = mode.route
    if dropout_p != 0.0:
        raise ValueError(f"dropout_p: ctxpar computes exact attention; got {dropout_p} (the "
                         "modules' dropout=0.0, or .eval())")
    named = (("query", query), ("key", key), ("value", value))
    for name, x in named:
        if not isinstance(x, torch.Tensor) or x.ndim != 4:
            got = f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name}: scaled_dot_product_attention inside ctxpar's "
                             f"context_parallel takes 4-D [B, H, T, D] tensors, got {got}")
    if not enable_gqa and query.shape[1] != key.shape[1]:
        raise ValueError(f"enable_gqa=False but query has {query.shape[1]} heads and key "
                         f"{key.shape[1]} (torch's scaled_dot_product_attention refuses this "
                         "too); pass enable_gqa=True for grouped-query attention")
    if attn_mask is not None:  # one that restates causal attention means it
        _check_block_mask(attn_mask, query.shape[2], mode.route)
        is_causal = True
    if layout == "balanced" and not is_causal:
        raise ValueError(
            "is_causal=False: this context_parallel block shards by the balanced layout of "
            "causal attention within its documents, and attention without the causal rule "
            "would need another layout of the tokens; pass is_causal=True (attention within "
            "each document, causally), or use layout='zigzag' with document_ids= for "
            "attention that is not causal")
    if enable_gqa and key.shape[1] != query.shape[1]:
        if query.shape[1] % key.shape[1]:
            raise ValueError(f"enable_gqa=True: query's {query.shape[1]} heads are no multiple "
                             f"of key's {key.shape[1]}")
        # transformers' sdpa repeats the kv heads where it built a mask and passes enable_gqa
        # where it did not: ranks with and without a mask must give cp_attention the same heads.
        group = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    mode.check_seq_dims(named)
    mode.route_recomputes()
    # [B, H, T, D] -> [B, T, H, D]: a strided view, no copy (last dim stays contiguous).
    out = cp_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), comm,
                       layout=layout, causal=is_causal, strategy=strategy, threads=threads,
                       scale=scale, bf16_tier=bf16_tier, document_ids=documents)
    return out.transpose(1, 2)


def _check_block_mask(mask, Tl, route):
    """attn_mask of a routed SDPA: accepted where it restates the block's causal attention
    (within documents) -- as transformers builds it, reading the shard's position ids as packed
    sequences, or exactly -- else refused, naming the first pair it changes."""
    comm, layout, _, _, _, documents, positions = route
    if positions is None or len(positions) != Tl:  # a fixed layout cuts any T
        positions = _layout.positions(Tl * comm.size, comm.size, comm.rank, layout,
                                      **_layout.causal_documents(layout, documents, _DOCUMENTS))
    pos = torch.as_tensor(positions)
    ids, docs = pos, None
    if documents is not None:  # position ids restart at each document's first token
        every = torch.as_tensor(documents, dtype=torch.int64)
        _, inverse = torch.unique(every, return_inverse=True)
        first = torch.full((len(every),), len(every)).scatter_reduce(
            0, inverse, torch.arange(len(every)), "amin")
        docs, ids = every[pos], pos - first[inverse[pos]]
    what = "causal attention" + (" within the block's documents" if docs is not None else "")
    fix = ("ctxpar's context_parallel computes causal attention from global positions" +
           (" and document_ids" if docs is not None else
            " (packed documents: pass document_ids= to context_parallel)") +
           "; drop the mask, or call ctxpar.torch.cp_attention with mask= / document_ids=")
    _masks.check_restates("attn_mask", mask, [_masks.transformers_packed(ids),
                                              _masks.visible(pos, docs)], pos, what, fix)


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
    unit = _ctxpar._layout_granule(layout, P, T)
    if T % unit != 0:
        raise ValueError(f"buffers: the sequence of {T} tokens (buffers[0] dim {dims[0]}) cannot be "
                         f"cut into {P} equal shards by the {layout} layout (it needs T % {unit} "
                         "== 0); pad the sequence")
    return dims


def _check_buffer_roles(buffers, no_restore_buffers):
    """What the block may do to each buffer: swap its data for the shard (a leaf, once) and,
    for no_restore_buffers, leave it so. Returns the ids of the buffers not restored."""
    first = {}
    for i, b in enumerate(buffers):
        if id(b) in first:
            raise ValueError(f"buffers[{i}]: the same tensor as buffers[{first[id(b)]}]; pass "
                             "each tensor once (the block shards it in place)")
        first[id(b)] = i
        if not b.is_leaf:
            raise ValueError(
                f"buffers[{i}]: not a leaf tensor (made by {type(b.grad_fn).__name__}); the "
                "context_parallel block swaps its data for the shard, which the graph that made "
                "it cannot follow (its backward would meet the shard's shape). Pass the leaves "
                f"it is made from as buffers, or buffers[{i}].detach() (.requires_grad_() for a "
                "gradient of its own)")
    keep = set()
    for j, b in enumerate(no_restore_buffers or ()):
        if id(b) not in first:
            raise ValueError(f"no_restore_buffers[{j}]: not one of buffers (pass the same tensor "
                             "object in buffers too)")
        if b.grad is not None:
            i = first[id(b)]
            raise ValueError(
                f"no_restore_buffers[{j}]: buffers[{i}] has a .grad of shape "
                f"{tuple(b.grad.shape)} from before the block, but context_parallel leaves "
                "the buffer this rank's shard after it, which that gradient does not fit; set "
                f"buffers[{i}].grad = None first, or let the block restore the buffer")
        keep.add(id(b))
    return keep


# Buffers a block holds sharded, by id (process-wide: ranks as threads must not share one):
# another block on one of them would shard the shard.
_SHARDED = {}
_SHARDED_LOCK = threading.Lock()


@contextlib.contextmanager
def _hold(buffers):
    """Marks `buffers` as sharded for the block's life; refuses one already held."""
    with _SHARDED_LOCK:
        for i, b in enumerate(buffers):
            if _SHARDED.get(id(b)) is b:
                raise ValueError(
                    f"buffers[{i}]: already sharded by a context_parallel block that has not "
                    "ended (a block inside another on the same tensor would shard the shard; "
                    "ranks that run as threads need a tensor each); pass it to one block only")
        _SHARDED.update((id(b), b) for b in buffers)
    try:
        yield
    finally:
        with _SHARDED_LOCK:
            for b in buffers:
                _SHARDED.pop(id(b), None)


# Where context_parallel and context_parallel_unshard take the documents the balanced layout
# balances (the refusal without them says so).
_DOCUMENTS = ("pass document_ids= (one id per token of the whole sequence) or cu_seqlens= "
              "(flash_attn_varlen_func's offsets [0, l0, l0 + l1, ..., T])")


@contextlib.contextmanager
def context_parallel(mesh, buffers=(), buffer_seq_dims=(), no_restore_buffers=None,
                     layout="zigzag", strategy=None, threads=1, bf16_tier="exact",
                     document_ids=None, cu_seqlens=None):
    """Shards `buffers` in place along `buffer_seq_dims` (this rank's tokens in `layout`
    order) and, inside the block, runs torch's scaled_dot_product_attention on ctxpar (by a
    TorchFunctionMode: names bound before the block, nn.MultiheadAttention and the
    nn.Transformer layers, and torch.utils.checkpoint's recomputes are routed too). `mesh` is a
    1-D torch DeviceMesh (e.g. mesh["cp"], torch's own signature) or a ctxpar.Communicator. On
    exit, even by an exception, every buffer not in no_restore_buffers gets its full contents
    back. A restored buffer's .grad comes back whole too: the shard gradients of a backward
    inside the block are gathered from every rank (collective) into the full shape and added to
    the gradient it held before the block (on an exception the block's shard gradient is
    dropped). Buffers are leaves, each passed once and to one block at a time.
    strategy: None is set_rotate_method's choice (default "ring").
    bf16_tier: cp_attention's ("exact" or "fast"). document_ids (T ints, the whole sequence) or
    cu_seqlens (flash_attn_varlen_func's offsets): attention inside each document, and the
    masks transformers builds from per-document position ids accepted (docs/python.md).
    layout="balanced" (with documents) shards by the balanced layout of causal attention within
    them, solved once on entry, after the ranks agree on the documents (collective); SDPA
    inside must then be causal. Needs torch >= 2.0 (scaled_dot_product_attention)."""
    comm = _communicator(mesh)
    if _SDPA is None:
        raise RuntimeError(f"context_parallel: torch {torch.__version__} has no "
                           "scaled_dot_product_attention to route (torch >= 2.0 has); call "
                           "ctxpar.torch.cp_attention on the shards instead")
    layout = _checks.choice("layout", layout, _checks.LAYOUTS)
    strategy = _checks.choice("strategy", _rotate[0] if strategy is None else strategy,
                              _checks.STRATEGIES)
    threads = _checks.threads(threads)
    bf16_tier = _checks.bf16_tier(bf16_tier)

    def checked():
        documents = _documents(document_ids, cu_seqlens)
        balance = _layout.causal_documents(layout, documents, _DOCUMENTS)
        bufs = list(buffers)
        dims = _check_buffers(comm, bufs, list(buffer_seq_dims), layout)
        if documents is not None and bufs and len(documents) != bufs[0].shape[dims[0]]:
            raise ValueError(f"document_ids: {len(documents)} ids for a sequence of "
                             f"{bufs[0].shape[dims[0]]} tokens (buffers[0] dim {dims[0]}); pass "
                             "one id per token of the whole sequence")
        return documents, balance, bufs, dims, _check_buffer_roles(bufs, no_restore_buffers)

    if layout == "balanced":
        # The layout is the documents' own: ranks that shard by different documents would hold
        # some tokens twice and others nowhere. They agree before any buffer changes.
        documents, balance, buffers, dims, keep = agree_after(
            comm, "context_parallel", checked,
            lambda made: [("layout", layout), ("document_ids", digest(made[0]))])
    else:
        documents, balance, buffers, dims, keep = checked()
    tokens = buffers[0].shape[dims[0]] if buffers else (
        None if documents is None else len(documents))
    # The block's layout, solved once (the balanced solver is O((T/64)^2)): this rank's tokens
    # for the shards and the routed masks, every rank's inverse for the gradients on exit.
    perm = inverse = positions = None
    if tokens is not None:
        perm, inverse = _layout.permutation(tokens, comm.size, layout, **balance)
        Tl = tokens // comm.size
        positions = perm[comm.rank * Tl:(comm.rank + 1) * Tl]
    with _hold(buffers):
        originals = [b.data for b in buffers]
        shards = [_layout._take(b.data, positions, d) for b, d in zip(buffers, dims)]
        # Gradients from before the block (full shape) wait here; the block's start at None.
        grads_before = [b.grad if id(b) not in keep else None for b in buffers]
        checked = [(i, b, d, tuple(full.shape))
                   for i, (b, d, full) in enumerate(zip(buffers, dims, originals))]
        route = (comm, layout, strategy, threads, bf16_tier, documents, positions)
        ok = False
        try:
            for b, s, g in zip(buffers, shards, grads_before):
                if g is not None:
                    b.grad = None
                b.data = s  # in place: the caller's tensor object now holds its shard
            with _RouteAttention(route, checked):
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
                    whole = _layout.gather(g, comm, inverse, d)
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


# torch.distributed.tensor.experimental.set_rotate_method's names for how K/V shards move,
# as ctxpar's strategies: torch's "alltoall" passes each rank's shard on to the next (ring
# attention: ctxpar's ring), "allgather" gathers every shard first (ctxpar's allgather).
_ROTATE_METHODS = {"alltoall": "ring", "allgather": "allgather"}
_rotate = ["ring"]  # process-wide, as torch's


def set_rotate_method(rotate_method):
    """torch's set_rotate_method: the strategy of the context_parallel blocks begun after it that
    name none, for the whole process (every rank must set the same). "alltoall" -> "ring",
    "allgather" -> "allgather"; a block's strategy= (any of ctxpar's) overrides it."""
    _rotate[0] = _ROTATE_METHODS[_checks.choice("rotate_method", rotate_method,
                                                tuple(_ROTATE_METHODS))]


def context_parallel_unshard(mesh, buffers, seq_dims, layout="zigzag", *, document_ids=None,
                             cu_seqlens=None):
    """torch's context_parallel_unshard: each of `buffers` (this rank's shard, tokens in
    `layout` order along its seq dim) gathered from every rank into the whole tensor in global
    order -- the layout's inverse. Collective; returns new tensors (on each shard's device), no
    gradient. mesh: a 1-D DeviceMesh or a ctxpar.Communicator, as context_parallel's.
    layout="balanced" needs the block's document_ids= or cu_seqlens= (its layout is theirs)."""
    comm = _communicator(mesh)
    layout = _checks.choice("layout", layout, _checks.LAYOUTS)
    balance = _layout.causal_documents(layout, _documents(document_ids, cu_seqlens), _DOCUMENTS)
    buffers, seq_dims = list(buffers), list(seq_dims)
    if len(buffers) != len(seq_dims):
        raise ValueError(f"seq_dims: {len(seq_dims)} entries for {len(buffers)} buffers; pass "
                         "one seq dim per buffer")
    for i, b in enumerate(buffers):
        if not isinstance(b, torch.Tensor) or b.ndim == 0:
            got = "a 0-D tensor" if isinstance(b, torch.Tensor) else type(b).__name__
            raise TypeError(f"buffers[{i}]: expected a torch tensor with a seq dim, got {got}")
        seq_dims[i] = _checks.whole(f"seq_dims[{i}]", seq_dims[i], -b.ndim, b.ndim - 1)
    return [_layout.unshard(b, comm, layout=layout, seq_dim=d, **balance)
            for b, d in zip(buffers, seq_dims)]

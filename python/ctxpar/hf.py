"""Hugging Face transformers models with context parallelism: attn_implementation="ctxpar".

    ctxpar.hf.register()
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="ctxpar")
    local = ctxpar.hf.shard_batch({"input_ids": ids, "document_ids": docs}, comm)
    loss = model(**local).loss          # this rank's share of the global mean
    loss.backward()
    ctxpar.hf.all_reduce_gradients(model, comm)

Every rank runs the whole model on its share of the sequence (ctxpar.layout.shard); only the
attention crosses ranks, through ctxpar.torch.cp_attention. The communicator, layout and
documents of the sequence being trained on are this thread's CP context (shard_batch sets it;
`with context(comm, ...)` too), so ranks that run as threads each have their own. See
docs/python.md, "Hugging Face".
"""
import contextlib
import threading

import numpy as np
import torch

from . import _checks
from . import _ctxpar
from . import _masks
from . import layout as _layout
from ._agreement import agree_after, digest
from .torch import cp_attention

NAME = "ctxpar"
IGNORE_INDEX = -100  # transformers' ignore_index for labels

# This thread's Context: ranks that run as threads (ctxpar.run_threads) each have their own.
_local = threading.local()


def _get():
    return getattr(_local, "ctx", None)


def _set(ctx):
    _local.ctx = ctx


# Where ctxpar.hf takes the documents the balanced layout balances (its refusal says so).
_DOCUMENTS = ("pass document_ids ([T]) or cu_seqlens ([n + 1] offsets) in the batch given to "
              "ctxpar.hf.shard_batch (hf.context: document_ids=)")


class Context:
    """The sequence this thread's rank is training on: comm, layout, document ids of the whole
    sequence (int32 [T], None: one document), this rank's position_ids [B, Tl] or [Tl] (the
    per-document positions the model must rotate by; None: not checked) and this rank's global
    token indices in the layout (None: found from the first attention's length, once)."""

    def __init__(self, comm, layout, document_ids, position_ids, tokens=None):
        self.comm, self.layout = comm, layout
        self.document_ids, self.position_ids = document_ids, position_ids
        self.tokens = tokens

    def rank_tokens(self, Tl):
        """This rank's Tl global token indices: the balanced layout is solved once per
        context (causal attention within its documents, as cp_attention balances it)."""
        if self.tokens is None or len(self.tokens) != Tl:
            P = self.comm.size
            self.tokens = _layout.positions(
                Tl * P, P, self.comm.rank, self.layout,
                **_layout.causal_documents(self.layout, self.document_ids, _DOCUMENTS))
        return self.tokens


def _current():
    ctx = _get()
    if ctx is None:
        raise RuntimeError(
            f'attn_implementation="{NAME}": no CP context on this thread; shard the batch with '
            "ctxpar.hf.shard_batch(batch, comm) (or enter `with ctxpar.hf.context(comm, ...)`) "
            "before calling the model")
    return ctx


def _check_comm(comm):
    if not isinstance(comm, _ctxpar.Communicator):
        raise TypeError(f"comm: expected a ctxpar.Communicator, got {type(comm).__name__}")


def _documents(document_ids, cu_seqlens, T):
    """document_ids ([T], or [B, T] with equal rows) or cu_seqlens ([n + 1], 0 ... T) as int32
    [T], or None for one document."""
    if document_ids is not None and cu_seqlens is not None:
        raise ValueError("batch: pass document_ids or cu_seqlens, not both")
    if cu_seqlens is not None:
        cu = torch.as_tensor(cu_seqlens).reshape(-1).long().cpu()
        if cu.numel() < 2 or cu[0] != 0 or cu[-1] != T or (cu[1:] <= cu[:-1]).any():
            raise ValueError(f"cu_seqlens: expected increasing offsets from 0 to the sequence "
                             f"length {T} (documents of at least one token), got "
                             f"{cu.tolist()}")
        return torch.repeat_interleave(torch.arange(cu.numel() - 1),
                                       cu[1:] - cu[:-1]).numpy().astype(np.int32)
    if document_ids is None:
        return None
    d = torch.as_tensor(document_ids).cpu()
    if d.ndim == 2:
        if (d != d[:1]).any():
            raise ValueError("document_ids: rows differ; ctxpar attends every row of a batch "
                             "with one packing (one row per step, or the same packing in each)")
        d = d[0]
    if d.ndim != 1 or d.shape[0] != T:
        raise ValueError(f"document_ids: expected [T] or [B, T] with T = {T} (input_ids' "
                         f"length), got shape {tuple(d.shape)}")
    if d.dtype.is_floating_point or (d[1:] < d[:-1]).any():
        raise ValueError("document_ids: expected whole numbers, non-decreasing along the "
                         "sequence (each document's tokens together)")
    return d.numpy().astype(np.int32)


def _document_positions(documents, T):
    """Positions [T] restarting at 0 where a document starts (arange for one document)."""
    pos = torch.arange(T)
    if documents is None:
        return pos
    d = torch.from_numpy(documents.astype(np.int64))
    start = torch.ones(T, dtype=torch.bool)
    start[1:] = d[1:] != d[:-1]
    first = torch.cummax(torch.where(start, pos, torch.zeros_like(pos)), 0).values
    return pos - first


def _shift_labels(labels, documents):
    """labels [B, T] -> shift_labels [B, T]: token t is scored on labels[t + 1]; the last token
    of each document (and of the sequence) has nothing to predict there (IGNORE_INDEX)."""
    shifted = torch.full_like(labels, IGNORE_INDEX)
    shifted[:, :-1] = labels[:, 1:]
    if documents is not None:
        d = torch.from_numpy(documents.astype(np.int64))
        shifted[:, :-1][:, d[1:] != d[:-1]] = IGNORE_INDEX
    return shifted


def shard_batch(batch, comm, layout="zigzag"):
    """This rank's share of a causal-LM batch, ready for model(**local), and this thread's CP
    context for attn_implementation="ctxpar" (until the next shard_batch or context).

    batch: a dict with input_ids [B, T]; optional labels [B, T] (default input_ids; tokens not
    to score hold -100, as transformers), position_ids [B, T] or [T] (default: 0.. per
    document), document_ids ([T], or [B, T] with equal rows) or cu_seqlens ([n + 1], offsets)
    for packed documents. Collective only in that every rank must call it with the same batch
    (layout="balanced", which needs the documents and balances causal attention within them:
    the ranks agree on the documents first, a collective).
    Returns {input_ids, position_ids, labels, shift_labels, num_items_in_batch}: [B, Tl] shards
    in `layout` order (ctxpar.layout.shard, cp_attention's order), labels shifted before
    sharding (token t predicts t + 1 of its own document), num_items_in_batch the global count
    of scored tokens (so each rank's loss is its share of the global mean)."""
    _check_comm(comm)
    layout = _checks.choice("layout", layout, _checks.LAYOUTS)
    if layout == "balanced":
        # The layout is the documents' own: ranks that shard by different documents would hold
        # some tokens twice and others nowhere.
        ids, labels, positions, documents, balance = agree_after(
            comm, "ctxpar.hf.shard_batch", lambda: _checked_batch(batch, comm, layout),
            lambda made: [("layout", layout), ("document_ids", digest(made[3]))])
    else:
        ids, labels, positions, documents, balance = _checked_batch(batch, comm, layout)
    T = ids.shape[1]
    shift = _shift_labels(labels, documents)
    tokens = _layout.positions(T, comm.size, comm.rank, layout, **balance)  # solved once

    def cut(x):
        return _layout._take(x, tokens, 1)

    local = {"input_ids": cut(ids), "position_ids": cut(positions), "shift_labels": cut(shift),
             "num_items_in_batch": int((shift != IGNORE_INDEX).sum())}
    # transformers computes a loss only when labels is passed; shift_labels is what it scores.
    local["labels"] = local["shift_labels"]
    _set(Context(comm, layout, documents, local["position_ids"], tokens))
    return local


def _checked_batch(batch, comm, layout):
    """shard_batch's batch checked: (input_ids, labels, position_ids [B, T], document ids or
    None, the layout's balance= of them)."""
    if not isinstance(batch, dict) or "input_ids" not in batch:
        raise TypeError("batch: expected a dict with input_ids [B, T] (and optional labels, "
                        "position_ids, document_ids or cu_seqlens)")
    unknown = set(batch) - {"input_ids", "labels", "position_ids", "document_ids",
                            "cu_seqlens", "attention_mask"}
    if unknown:
        raise ValueError(f"batch: unknown keys {sorted(unknown)}; shard_batch takes input_ids, "
                         "labels, position_ids, document_ids, cu_seqlens, attention_mask")
    ids = torch.as_tensor(batch["input_ids"])
    if ids.ndim != 2:
        raise ValueError(f"input_ids: expected [B, T], got shape {tuple(ids.shape)}")
    T = ids.shape[1]
    unit = _ctxpar._layout_granule(layout, comm.size, T)
    if T % unit:
        raise ValueError(f"input_ids: {T} tokens cannot be cut into {comm.size} equal shards by "
                         f"the {layout} layout (it needs T % {unit} == 0); pad or pack the "
                         f"sequence to {-(-T // unit) * unit} tokens")
    _check_no_padding(batch.get("attention_mask"))
    documents = _documents(batch.get("document_ids"), batch.get("cu_seqlens"), T)
    balance = _layout.causal_documents(layout, documents, _DOCUMENTS)
    labels = ids if batch.get("labels") is None else torch.as_tensor(batch["labels"])
    if tuple(labels.shape) != tuple(ids.shape):
        raise ValueError(f"labels: expected the shape of input_ids {tuple(ids.shape)}, got "
                         f"{tuple(labels.shape)}")
    positions = batch.get("position_ids")
    if positions is None:
        positions = _document_positions(documents, T).to(ids.device)[None, :].expand_as(ids)
    positions = torch.as_tensor(positions)
    if positions.ndim == 1:
        positions = positions[None, :]
    if positions.ndim != 2 or positions.shape[1] != T:
        raise ValueError(f"position_ids: expected [B, T] or [T] with T = {T}, got shape "
                         f"{tuple(positions.shape)}")
    return ids, labels, positions, documents, balance


@contextlib.contextmanager
def context(comm, layout="zigzag", document_ids=None, position_ids=None):
    """This thread's CP context for the block (the previous one back after it): the model is
    called on this rank's share of a sequence whose documents are document_ids ([T]; None:
    one), with position_ids its rank's global positions ([B, Tl] or [Tl]; None: not checked).
    layout="balanced" needs document_ids (the shards made by ctxpar.layout.shard(x, comm,
    "balanced", mask="causal", document_ids=...): causal attention within them)."""
    _check_comm(comm)
    layout = _checks.choice("layout", layout, _checks.LAYOUTS)
    documents = None if document_ids is None else _documents(document_ids, None,
                                                             len(document_ids))
    _layout.causal_documents(layout, documents, _DOCUMENTS)
    before = _get()
    ctx = Context(comm, layout, documents, position_ids)
    _set(ctx)
    try:
        yield ctx
    finally:
        _set(before)


def clear_context():
    """Forgets this thread's CP context (a later call of a ctxpar model then refuses)."""
    _set(None)


def _check_no_padding(attention_mask):
    """A 2-D attention_mask adds something to causal attention only where it hides a token."""
    if attention_mask is None:
        return
    m = torch.as_tensor(attention_mask)
    if m.ndim == 2 and not bool(m.bool().all()):
        raise ValueError(
            "attention_mask: it hides padding tokens, which ctxpar's attention does not read "
            "(its masks come from global positions and documents); pack the sequences without "
            "padding and pass document_ids (or cu_seqlens) to ctxpar.hf.shard_batch, or drop "
            "attention_mask")


def _check_mask(ctx, attention_mask, causal, Tl):
    """None, or a 4-D mask [B, 1|H, Tl, Tl] that only restates causal + documents (bool, or
    additive with 0 where visible): ignored. Anything else is refused, naming it."""
    if attention_mask is None:
        return
    pos = torch.as_tensor(ctx.rank_tokens(Tl))
    docs = None if ctx.document_ids is None else torch.as_tensor(ctx.document_ids[pos.numpy()])
    expected = _masks.visible(pos if causal else torch.zeros_like(pos), docs)
    what = ("causal attention" if causal else "attention") + (
        " within the documents ctxpar knows" if docs is not None else "")
    _masks.check_restates(
        "attention_mask", attention_mask, [expected], pos, what,
        "ctxpar's attention reads no mask (its masks come from global positions and "
        "documents): pack without padding and pass document_ids (or cu_seqlens) to "
        "ctxpar.hf.shard_batch, and drop the mask")


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                      is_causal=None, **kwargs):
    """transformers' attention interface on ctxpar: query [B, Hq, Tl, D], key / value
    [B, Hkv, Tl, D] of this rank's tokens -> ([B, Tl, Hq, D], None), attention over the whole
    distributed sequence of this thread's CP context."""
    ctx = _current()
    if dropout:
        raise ValueError(f"dropout: ctxpar computes exact attention; got attention_dropout "
                         f"{dropout} (set config.attention_dropout = 0.0)")
    for name in ("softcap", "sliding_window", "position_bias"):
        if kwargs.get(name) is not None:
            raise ValueError(f"{name}: not supported by attn_implementation=\"{NAME}\" (got "
                             f"{kwargs[name]!r}); use a model without it")
    if kwargs.get("output_attentions"):
        raise ValueError(f"output_attentions=True: attn_implementation=\"{NAME}\" computes no "
                         "attention weights (they span ranks); use 'eager' for them")
    Tl = query.shape[2]
    if key.shape[2] != Tl:
        raise ValueError(f"key: {key.shape[2]} keys for {Tl} queries (a cache from earlier "
                         f"steps?); attn_implementation=\"{NAME}\" trains on a sharded sequence: "
                         "call the model with use_cache=False")
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    if ctx.layout == "balanced" and not causal:
        raise ValueError(
            f"is_causal=False ({type(module).__name__}): the CP context shards by the balanced "
            "layout of causal attention within its documents, and attention without the causal "
            "rule would need another layout of the tokens; use ctxpar.hf.shard_batch(..., "
            "layout='zigzag') for a model that is not causal")
    _check_mask(ctx, attention_mask, causal, Tl)
    _check_positions(ctx, kwargs.get("position_ids"), Tl)
    out = cp_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                       ctx.comm, layout=ctx.layout, causal=causal,
                       document_ids=ctx.document_ids, scale=scaling)
    return out, None


def _check_positions(ctx, position_ids, Tl):
    """The model rotates by the position_ids it was called with: they must be the context's
    (without them transformers uses 0..Tl-1, wrong for every rank's share: silently wrong RoPE)."""
    expected = ctx.position_ids
    if expected is None or position_ids is expected:  # shard_batch's own tensor, passed on
        return
    expected = torch.as_tensor(expected)
    got = position_ids
    ok = got is not None and tuple(got.shape[-1:]) == (Tl,) and bool(
        (torch.as_tensor(got).to(expected.device) == expected).all())
    if not ok:
        what = "none (transformers then uses 0..Tl-1)" if got is None else \
            f"shape {tuple(got.shape)}, not this rank's share"
        raise ValueError(
            f"position_ids: the model was called with {what}; pass the position_ids "
            "ctxpar.hf.shard_batch returned (model(**local)), the global per-document positions "
            "of this rank's tokens, so that RoPE rotates each token by its place in the sequence")


def mask_interface(batch_size=None, q_length=None, kv_length=None, q_offset=0, kv_offset=0,
                   mask_function=None, attention_mask=None, **kwargs):
    """transformers' mask function for "ctxpar": builds no mask (cp_attention knows causal and
    the documents) and refuses a 2-D attention_mask that hides tokens (padding)."""
    _check_no_padding(attention_mask)
    return None


def register(name=NAME):
    """Adds attn_implementation=name (default "ctxpar") to transformers' AttentionInterface and
    AttentionMaskInterface. Safe to call again."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as e:
        raise RuntimeError(f"ctxpar.hf.register: transformers (>= 5) is not importable ({e}); "
                           "pip install transformers") from e
    AttentionInterface.register(name, attention_forward)
    # Without a mask function of its own, transformers drops a 2-D attention_mask for a custom
    # attention silently; this one refuses padding instead.
    AttentionMaskInterface.register(name, mask_interface)


def all_reduce_gradients(model, comm):
    """Sums every parameter's gradient over the ranks of comm (one comm.allreduce, in rank
    order), so each rank steps with the gradient of the whole sequence. model: a torch module
    or an iterable of parameters; one that requires grad but has none here counts as zeros.
    Collective: every rank calls it with the same parameters. Gradients on a GPU or in bfloat16
    go through one float32 host buffer (a CUDA trainer of many ranks may prefer DDP over the
    cp group, whose all-reduce stays on the device)."""
    _check_comm(comm)
    params = model.parameters() if isinstance(model, torch.nn.Module) else model
    params = [p for p in params if p.requires_grad]
    # A parameter without a gradient on this rank (unused by its tokens) takes part as zeros:
    # every rank reduces the same list, in one order.
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    if not grads:
        return
    wide = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    # One contiguous host buffer of a dtype comm.allreduce takes (bf16 / CUDA staged through it).
    flat = torch.cat([g.detach().reshape(-1).to("cpu", wide) for g in grads])
    comm.allreduce(flat.numpy())
    offset = 0
    for g in grads:
        g.copy_(flat[offset: offset + g.numel()].view_as(g))
        offset += g.numel()

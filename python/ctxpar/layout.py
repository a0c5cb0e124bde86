"""How global tokens map to ranks (see docs/layouts.md): contiguous, zigzag, striped, balanced.

    q_local = ctxpar.layout.shard(q, comm, layout="zigzag", seq_dim=1)
    q = ctxpar.layout.unshard(q_local, comm, layout="zigzag", seq_dim=1)

Works on NumPy arrays and torch tensors (torch: differentiable, shard is an index_select).
The balanced layout balances a mask's work (packed documents, prefix trees, any slice mask):
pass the same mask= and document_ids= (or cu_seqlens=) as to the attention, on every rank.

    perm, inverse = ctxpar.layout.permutation(T, P, "balanced", mask="causal", document_ids=ids)
"""
import numpy as np

from . import _checks
from . import _ctxpar
from ._arrays import framework

LAYOUTS = _checks.LAYOUTS


def _balance(mask, document_ids, cu_seqlens, layout="balanced"):
    from ._attention import documents, mask_text
    if layout == "balanced" and (isinstance(mask, str) and mask == "none") and \
            document_ids is None and cu_seqlens is None:
        # Sharded without the mask, the tokens would land where the attention (which balances
        # the mask it is given) does not look for them: a silently wrong result.
        raise ValueError("layout: 'balanced' assigns tokens by the mask's work: pass the mask= "
                         "and document_ids= (or cu_seqlens=) you pass to the attention, the same "
                         "on every rank (context_parallel and ctxpar.hf take document_ids= or "
                         "cu_seqlens= and balance causal attention within them)")
    return dict(mask=mask_text(mask), documents=documents(document_ids, cu_seqlens))


def causal_documents(layout, document_ids, how):
    """The balance= of context_parallel's and ctxpar.hf's sharding, whose attention is causal
    within the documents: {} for the fixed layouts; for the balanced layout the mask it
    balances, refused without documents. how: where the caller passes them."""
    if layout != "balanced":
        return {}
    if document_ids is None:
        raise ValueError(f"layout: 'balanced' balances causal attention within packed "
                         f"documents, and none were given: {how}. For one document keep the "
                         "default layout='zigzag', which balances causal attention already")
    return dict(mask="causal", document_ids=document_ids)


def positions(tokens, ranks, rank, layout="zigzag", *, mask="none", document_ids=None,
              cu_seqlens=None):
    """Global positions (int64, increasing) of rank `rank`'s tokens out of `tokens`. The
    balanced layout reads mask= and document_ids= (or cu_seqlens=); the others ignore them."""
    layout = _checks.choice("layout", layout, LAYOUTS)
    tokens = _checks.whole("tokens", tokens, 1, _checks.MAX_TOKENS)
    ranks = _checks.whole("ranks", ranks, 1, _checks.MAX_PROCESSES)
    rank = _checks.whole("rank", rank, 0, ranks - 1)
    return np.asarray(_ctxpar._layout_positions(layout, tokens, ranks, rank,
                                                **_balance(mask, document_ids, cu_seqlens,
                                                           layout)),
                      dtype=np.int64)


def permutation(tokens, ranks, layout="zigzag", *, mask="none", document_ids=None,
                cu_seqlens=None):
    """(perm, inverse): perm lists the global token index at each slot, rank 0's tokens first
    (x[..., perm, ...] is every rank's shard concatenated); inverse restores global order (as
    torch's _generate_indices(restore=True)). For position ids, labels and anything per token."""
    layout = _checks.choice("layout", layout, LAYOUTS)
    tokens = _checks.whole("tokens", tokens, 1, _checks.MAX_TOKENS)
    ranks = _checks.whole("ranks", ranks, 1, _checks.MAX_PROCESSES)
    perm = np.asarray(_ctxpar._layout_positions(layout, tokens, ranks, -1,
                                                **_balance(mask, document_ids, cu_seqlens,
                                                           layout)),
                      dtype=np.int64)
    return perm, np.argsort(perm, kind="stable")


def _seq_dim(x, seq_dim, name):
    if x.ndim == 0:
        raise ValueError(f"{name}: a 0-D tensor has no sequence dimension")
    return _checks.whole(f"seq_dim (of {name}, {x.ndim} dimensions)", seq_dim, -x.ndim,
                         x.ndim - 1) % x.ndim


def _take(x, index, dim):
    if framework(x, "x") == "torch":
        import torch
        return x.index_select(dim, torch.as_tensor(index, device=x.device))
    return np.take(x, index, axis=dim)


def shard(x, comm=None, layout="zigzag", seq_dim=1, *, rank=None, ranks=None, **balance):
    """Rank `rank`'s share (default: comm.rank of comm.size) of x along seq_dim. balance:
    mask=, document_ids=, cu_seqlens= for the balanced layout (positions())."""
    rank, ranks = _rank_of(comm, rank, ranks)
    d = _seq_dim(x, seq_dim, "x")
    return _take(x, positions(x.shape[d], ranks, rank, layout, **balance), d)


def shard_all(x, ranks, layout="zigzag", seq_dim=1, **balance):
    """Every rank's share of x, as a list indexed by rank."""
    return [shard(x, rank=r, ranks=ranks, layout=layout, seq_dim=seq_dim, **balance)
            for r in range(ranks)]


def unshard_all(shards, layout="zigzag", seq_dim=1, **balance):
    """Inverse of shard_all: the full tensor from every rank's share (rank order)."""
    ranks = len(shards)
    d = _seq_dim(shards[0], seq_dim, "shards[0]")
    local = shards[0].shape[d]
    for r, s in enumerate(shards):
        if tuple(s.shape) != tuple(shards[0].shape):
            raise ValueError(f"shards[{r}]: shape {tuple(s.shape)} differs from shards[0]'s "
                             f"{tuple(shards[0].shape)}")
    _, inverse = permutation(local * ranks, ranks, layout, **balance)
    if framework(shards[0], "shards[0]") == "torch":
        import torch
        return _take(torch.cat(list(shards), dim=d), inverse, d)
    return _take(np.concatenate(shards, axis=d), inverse, d)


def unshard(x_local, comm, layout="zigzag", seq_dim=1, **balance):
    """The full tensor on every rank, gathered from each rank's share (collective)."""
    d = _seq_dim(x_local, seq_dim, "x_local")
    _, inverse = permutation(x_local.shape[d] * comm.size, comm.size, layout, **balance)
    return gather(x_local, comm, inverse, d)


def gather(x_local, comm, inverse, seq_dim):
    """unshard by a permutation's inverse already computed (context_parallel keeps its
    layout's for the block's life): every rank's x_local, concatenated along seq_dim in rank
    order, taken at `inverse` (collective)."""
    d = _seq_dim(x_local, seq_dim, "x_local")
    is_torch = framework(x_local, "x_local") == "torch"
    if is_torch:
        import torch
        x = x_local.detach().cpu().contiguous()
        # NumPy has no bfloat16: move its bits as int16.
        local = (x.view(torch.int16) if x.dtype == torch.bfloat16 else x).numpy()
    else:
        local = np.ascontiguousarray(x_local)
    gathered = np.empty((comm.size,) + local.shape, dtype=local.dtype)
    comm.allgather(local, gathered)
    full = np.ascontiguousarray(_take(np.concatenate(list(gathered), axis=d), inverse, d))
    if is_torch:
        out = torch.from_numpy(full)
        out = out.view(torch.bfloat16) if x_local.dtype == torch.bfloat16 else out
        return out.to(x_local.device)  # a CUDA shard's whole comes back on its GPU
    return full


def _rank_of(comm, rank, ranks):
    if comm is not None:
        return comm.rank, comm.size
    if rank is None or ranks is None:
        raise ValueError("comm: pass a communicator, or rank= and ranks=")
    ranks = _checks.whole("ranks", ranks, 1, _checks.MAX_PROCESSES)
    return _checks.whole("rank", rank, 0, ranks - 1), ranks

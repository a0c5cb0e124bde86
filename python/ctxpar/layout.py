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
    from ._attention import document_ids_from_cu_seqlens, mask_text
    from ._arrays import int_array
    if layout == "balanced" and (isinstance(mask, str) and mask == "none") and \
            document_ids is None and cu_seqlens is None:
        # Sharded without the mask, the tokens would land where the attention (which balances
        # the mask it is given) does not look for them: a silently wrong result.
        raise ValueError("layout: 'balanced' assigns tokens by the mask's work: pass the mask= "
                         "and document_ids= (or cu_seqlens=) you pass to the attention, the same "
                         "on every rank (context_parallel and ctxpar.hf shard with the fixed "
                         "layouts: zigzag, striped, contiguous)")
    if cu_seqlens is not None:
        if document_ids is not None:
            raise ValueError("cu_seqlens: pass cu_seqlens or document_ids, not both")
        document_ids = document_ids_from_cu_seqlens(cu_seqlens)
    return dict(mask=mask_text(mask), documents=int_array(document_ids, "document_ids", "int32"))


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
    order = np.concatenate([positions(local * ranks, ranks, r, layout, **balance)
                            for r in range(ranks)])
    inverse = np.argsort(order, kind="stable")
    if framework(shards[0], "shards[0]") == "torch":
        import torch
        return _take(torch.cat(list(shards), dim=d), inverse, d)
    return _take(np.concatenate(shards, axis=d), inverse, d)


def unshard(x_local, comm, layout="zigzag", seq_dim=1, **balance):
    """The full tensor on every rank, gathered from each rank's share (collective)."""
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
    full = np.ascontiguousarray(unshard_all(list(gathered), layout=layout, seq_dim=d, **balance))
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

"""4-D masks a model hands to ctxpar's attention, read back as what they say: ctxpar computes
its masks from global positions and documents, so a mask is accepted only where it restates
them, and refused naming the first (query, key) pair where it says more (the one home of
that check, for ctxpar.hf's attention and the context_parallel block's SDPA)."""
import torch


def visible(positions, documents=None):
    """[n, n] bool: may the token at global position positions[i] see the one at positions[j]
    (causal, within a document; documents: the ids of those tokens, None for one document)."""
    ok = positions[None, :] <= positions[:, None]
    if documents is not None:
        ok &= documents[:, None] == documents[None, :]
    return ok


def transformers_packed(position_ids):
    """[n, n] bool: the mask transformers (>= 5, masking_utils) builds from a row of position
    ids that it reads as packed sequences (no cache, no attention_mask): a new sequence where a
    position is not its predecessor's + 1; causal on the position ids within a sequence. A
    zigzag shard's global positions (0..7, 24..31) read so as two sequences."""
    run = torch.ones_like(position_ids, dtype=torch.bool)
    run[1:] = position_ids[1:] != position_ids[:-1] + 1
    seq = run.cumsum(0)
    return visible(position_ids) & (seq[:, None] == seq[None, :])


def check_restates(name, mask, candidates, positions, what, fix):
    """mask [B | 1, H | 1, n, n] (bool: True visible; or additive: 0 visible) must equal one of
    `candidates` ([n, n] bool) in every batch row and head; else ValueError naming `name`, the
    first (query, key) pair, by global position, where it differs from candidates[0] (`what`
    says what that one is) and `fix`."""
    if not isinstance(mask, torch.Tensor) or mask.ndim != 4 or mask.shape[-1] != mask.shape[-2] \
            or mask.shape[-1] != len(positions):
        shape = tuple(mask.shape) if hasattr(mask, "shape") else type(mask).__name__
        raise ValueError(f"{name}: expected a 4-D mask [B, 1 or H, {len(positions)}, "
                         f"{len(positions)}] of this rank's tokens, got {shape}; {fix}")
    shown = (mask if mask.dtype == torch.bool else mask == 0).cpu()
    for c in candidates:
        if bool((shown == c).all()):
            return
    i, j = (shown != candidates[0]).nonzero()[0].tolist()[-2:]
    q, k = int(positions[i]), int(positions[j])
    if candidates[0][i, j]:
        said = f"hides key {k} from query {q} (global positions) that {what} shows"
    else:
        said = f"shows key {k} to query {q} (global positions) that {what} hides"
    raise ValueError(f"{name}: the mask {said}; {fix}")

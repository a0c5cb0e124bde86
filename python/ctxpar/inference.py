"""ctxpar.KVCache: a KV cache spread over the ranks of a communicator, with prefill (pass-KV /
pass-Q) and decode, for long-context inference from NumPy or torch (CPU tensors, float32 /
bfloat16). The Python face of ctxpar::KvCache (include/ctxpar/inference.h); see
docs/inference.md.

    comm = ctxpar.init()                      # mpirun / torchrun / one rank; or run_threads
    cache = ctxpar.KVCache(comm, kv_heads=2, head_dim=64, sequences=B, mask="causal")
    out, lse = cache.prefill(q, k, v, seq=0)  # all T new tokens [1, T, H, D] on every rank
    out, lse = cache.decode(q_new, k_new, v_new)  # [B, Tn, H, D] for all B sequences

Every rank makes the same calls with the same arguments (the tensors replicated, as a model
whose activations are replicated has them); each keeps only its share of the K/V (block
round-robin: token t lives on rank (t // block) % P), and the outputs come back whole on every
rank, bitwise the same on all of them. prefill_local / append_local take only this rank's rows
(cache.placement(...)) for models whose activations are themselves spread.
"""
from . import _checks
from . import _ctxpar
from ._arrays import Tensors, check_attention_shapes, int_array
from ._attention import mask_text

PREFILL_MODES = ("auto", "pass-kv", "pass-q")


def _whole(name, value, lo=0, hi=1 << 62):
    return _checks.whole(name, value, lo, hi)


class KVCache:
    """B sequences' K/V spread over the ranks of `comm` (None: ctxpar.init()).

    kv_heads, head_dim: the cache's Hkv and D (queries may have any multiple of Hkv heads:
    GQA). sequences: 1 .. 2^20 (the command's --batch range). dtype: storage, "float32" or
    "bfloat16". mask: "causal" (default), "causal+window:L,0", ("window", L, 0): a mask that
    hides every later token (ValueError for "none", a right bound above 0, ...: the cache holds
    only the tokens so far; docs/inference.md); documents=True adds the documents rule (then
    every call takes document_ids, one per new token). block: the placement block (tokens).
    max_tokens_per_rank / max_bytes_per_rank: limits per rank (0: none), checked for every
    rank before a call changes anything (ValueError naming the field); check_memory_limit:
    also refuse growth past this process's memory limit. device: "cpu" or "sim". bf16_tier:
    "exact" (default) or "fast" (bfloat16 caches: P rounded to bfloat16 before P V in prefill
    and decode, as GPU flash attention; its own accuracy rule, docs/kernel.md "bf16 tiers");
    float32 caches ignore it; every rank must pass the same (else the first prefill / decode
    raises ValueError naming it)."""

    def __init__(self, comm=None, *, kv_heads, head_dim, sequences=1, dtype="float32",
                 mask="causal", documents=False, block=64, threads=1, scale=None,
                 device="cpu", max_tokens_per_rank=0, max_bytes_per_rank=0,
                 check_memory_limit=True, bf16_tier="exact"):
        if comm is None:
            from . import init
            comm = init()
        if not isinstance(comm, _ctxpar.Communicator):
            raise TypeError(f"comm: expected a ctxpar.Communicator (ctxpar.init(), "
                            f"run_threads, Communicator.from_torch), got {type(comm).__name__}")
        dtype = str(dtype).replace("torch.", "")
        text = mask_text(mask)
        if documents and "documents" not in text:
            text = "documents" if text == "none" else text + "+documents"
        self.documents = "documents" in text
        self.comm = comm
        self.mask = text
        self._cache = _ctxpar._KvCache(
            comm, _whole("sequences", sequences, 1, _checks.MAX_BATCH),
            _whole("kv_heads", kv_heads, 1, _checks.MAX_HEADS),
            _whole("head_dim", head_dim, 1, 1 << 16), dtype, _whole("block", block, 1),
            text, _checks.threads(threads), _checks.scale(scale), str(device),
            _whole("max_tokens_per_rank", max_tokens_per_rank),
            float(max_bytes_per_rank), bool(check_memory_limit), _checks.bf16_tier(bf16_tier))
        self.sequences, self.kv_heads, self.head_dim = sequences, kv_heads, head_dim
        self.dtype, self.block, self.bf16_tier = dtype, block, bf16_tier

    # ---- sizes, placement, memory ----------------------------------------------------------
    @property
    def ranks(self):
        return self.comm.size

    @property
    def rank(self):
        return self.comm.rank

    def tokens(self, seq=0):
        """Global length of sequence seq (all ranks)."""
        return self._cache.tokens(self._seq(seq))

    @property
    def lengths(self):
        return [self._cache.tokens(s) for s in range(self.sequences)]

    def local_tokens(self, seq=0):
        """Tokens of sequence seq this rank holds."""
        return self._cache.local_tokens(self._seq(seq))

    def local_positions(self, seq=0):
        """Global positions of the tokens of sequence seq this rank holds (increasing)."""
        return self._cache.local_positions(self._seq(seq))

    @property
    def nbytes(self):
        """Bytes of this rank's shards now (whole blocks, spare room of growth included)."""
        return self._cache.bytes()

    def bytes_for(self, lengths, rank=None):
        """Bytes rank `rank` (default this one) needs for `lengths` tokens per sequence, in
        whole blocks: the arithmetic the limits use."""
        return self._cache.bytes_for(self._lengths(lengths), self.rank if rank is None else
                                     _whole("rank", rank, 0, self.ranks - 1))

    @property
    def token_bytes(self):
        """One token's k + v + position (+ document id) in the cache."""
        return self._cache.token_bytes()

    def reserve(self, lengths):
        """Sizes every shard for `lengths` tokens per sequence at once (checked like an
        append), so that growing to them neither copies nor takes more memory."""
        self._cache.reserve(self._lengths(lengths))

    def rank_of(self, index):
        """The rank that holds token `index` of any sequence."""
        return self._cache.rank_of(_whole("index", index))

    def placement(self, first, count, rank=None):
        """Indices in [first, first + count) that rank `rank` (default this one) holds."""
        return self._cache.placement(_whole("first", first), _whole("count", count),
                                     self.rank if rank is None else
                                     _whole("rank", rank, 0, self.ranks - 1))

    @property
    def last_stats(self):
        """What this rank did in the last decode / prefill: bytes_sent, bytes_received,
        wall_seconds, attention_seconds, merge_seconds, mode (prefill)."""
        return self._cache.last_stats()

    # ---- appending, prefill, decode ---------------------------------------------------------
    def append(self, k, v, seq=0, document_ids=None):
        """Stores the K/V of new tokens of sequence seq without attending: k, v [1, T, Hkv, D]
        hold all of them (the same on every rank); each rank keeps its share. No
        communication."""
        t = Tensors({"k": k, "v": v})
        self._cache.append(self._seq(seq), t["k"], t["v"], self._ids(document_ids))

    def append_local(self, count, k, v, seq=0, document_ids=None):
        """The same with only this rank's rows: k, v [1, m, Hkv, D] are the rows
        placement(tokens(seq), count) of the `count` new tokens."""
        t = Tensors({"k": k, "v": v})
        self._cache.append_local(self._seq(seq), _whole("count", count), t["k"], t["v"],
                                 self._ids(document_ids))

    def prefill(self, q, k, v, seq=0, mode="auto", document_ids=None, return_lse=True):
        """Attention of T new tokens of sequence seq over the whole sequence (its cached
        tokens and the new ones, under the mask), storing their K/V. q [1, T, Hq, D]; k, v
        [1, T, Hkv, D]: all T rows, the same on every rank. mode: "auto" (the one that moves
        fewer bytes), "pass-kv" or "pass-q" (forced); last_stats["mode"] says which ran.
        Returns out [1, T, Hq, D] (q's dtype) and lse [1, Hq, T] float32, whole on every
        rank. Collective."""
        t = Tensors({"q": q, "k": k, "v": v})
        check_attention_shapes(t["q"], t["k"], t["v"])
        _, T, Hq, D = t["q"].shape
        out, lse = t.empty(t["q"].shape), t.empty((1, Hq, T), like_dtype=False)
        self._cache.prefill(self._seq(seq), t["q"], t["k"], t["v"], out, lse, self._mode(mode),
                            self._ids(document_ids))
        out = t.restore(out)
        return (out, lse) if return_lse else out

    def prefill_local(self, new_tokens, q, k, v, seq=0, mode="auto", document_ids=None):
        """prefill with only this rank's rows: q [1, Tl, Hq, D], k, v [1, Tl, Hkv, D] are the
        rows placement(tokens(seq), new_tokens) of the new tokens; returns this rank's
        (out [1, Tl, Hq, D], lse [1, Hq, Tl])."""
        t = Tensors({"q": q, "k": k, "v": v})
        check_attention_shapes(t["q"], t["k"], t["v"])
        _, Tl, Hq, D = t["q"].shape
        out, lse = t.empty(t["q"].shape), t.empty((1, Hq, Tl), like_dtype=False)
        self._cache.prefill_local(self._seq(seq), _whole("new_tokens", new_tokens, 1), t["q"],
                                  t["k"], t["v"], out, lse, self._mode(mode),
                                  self._ids(document_ids))
        return t.restore(out), lse

    def decode(self, q, k_new, v_new, document_ids=None, return_lse=True):
        """Tn new tokens of every sequence at once (sequences of any lengths): q [B, Tn, Hq,
        D], k_new, v_new [B, Tn, Hkv, D], the same on every rank. Appends their K/V (each on
        the rank the rule names), attends over the whole cache and merges the ranks' partials
        in rank order: out [B, Tn, Hq, D] and lse [B, Hq, Tn] bitwise the same on every rank,
        and the same whatever was prefilled before. document_ids: B * Tn ids (row-major) with
        the documents rule. Collective."""
        t = Tensors({"q": q, "k_new": k_new, "v_new": v_new})
        check_attention_shapes(t["q"], t["k_new"], t["v_new"])
        B, Tn, Hq, D = t["q"].shape
        out, lse = t.empty(t["q"].shape), t.empty((B, Hq, Tn), like_dtype=False)
        ids = None if document_ids is None else int_array(
            _flat(document_ids), "document_ids", "int32")
        self._cache.decode(t["q"], t["k_new"], t["v_new"], out, lse, ids)
        out = t.restore(out)
        return (out, lse) if return_lse else out

    # ---- checks -----------------------------------------------------------------------------
    def _seq(self, seq):
        return _whole("seq", seq, 0, self.sequences - 1)

    def _lengths(self, lengths):
        lengths = [int(n) for n in lengths]
        if len(lengths) != self.sequences:
            raise ValueError(f"lengths: expected one length per sequence ({self.sequences}), "
                             f"got {len(lengths)}")
        return [_whole(f"lengths[{i}]", n) for i, n in enumerate(lengths)]

    def _ids(self, document_ids):
        return None if document_ids is None else int_array(document_ids, "document_ids",
                                                           "int32")

    @staticmethod
    def _mode(mode):
        return _checks.choice("mode", mode, PREFILL_MODES)


def _flat(ids):
    return ids.reshape(-1) if hasattr(ids, "reshape") else ids


def predict_prefill_bytes(cached, new_tokens, ranks, *, heads, kv_heads, head_dim, block=64,
                          kv_dtype="float32", q_dtype="float32", documents=False):
    """Bytes (all ranks together) that prefilling `new_tokens` after `cached` tokens moves in
    each mode, and the mode "auto" picks: {"pass-kv": ..., "pass-q": ..., "auto": name}."""
    kv, q, choice = _ctxpar._predict_prefill_bytes(
        _whole("cached", cached), _whole("new_tokens", new_tokens, 1),
        _whole("ranks", ranks, 1, _checks.MAX_PROCESSES), _whole("heads", heads, 1),
        _whole("kv_heads", kv_heads, 1), _whole("head_dim", head_dim, 1),
        _whole("block", block, 1), str(kv_dtype).replace("torch.", ""),
        str(q_dtype).replace("torch.", ""), bool(documents))
    return {"pass-kv": kv, "pass-q": q, "auto": choice}

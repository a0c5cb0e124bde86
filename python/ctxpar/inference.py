"""ctxpar.KVCache: a KV cache spread over the ranks of a communicator, with prefill (pass-KV /
pass-Q) and decode, for long-context inference from NumPy or torch (CPU tensors, float32 /
bfloat16). The Python face of ctxpar::KvCache (include/ctxpar/inference.h); see
docs/inference.md.

    comm = ctxpar.init()                      # mpirun / torchrun / one rank; or run_threads
    cache = ctxpar.KVCache(comm, kv_heads=2, head_dim=64, sequences=B, mask="causal")
    out, lse = cache.prefill(q, k, v, seq=0)  # all T new tokens [1, T, H, D] on every rank
    out, lse = cache.decode(q_new, k_new, v_new)  # [B, Tn, H, D] for all B sequences

A server's cache (docs/inference.md, "A server's cache"): add() a sequence per request (a freed
slot is reused), prefill several prompts of any lengths in one call (lists, seq=[...]), decode
any subset of the live sequences (seqs=[...]), free() a finished one; truncate() rolls back
rejected draft tokens, fork() starts a new sequence from a prefix, sharing its pages
copy-on-write (no row copied; docs/inference.md, "Paged storage").

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
    GQA). sequences: the sequences live at the start, 0 .. 2^20 (the command's --batch range);
    add() makes more, free() ends one. dtype: storage, "float32" or
    "bfloat16". mask: "causal" (default), "causal+window:L,0", ("window", L, 0): a mask that
    hides every later token (ValueError for "none", a right bound above 0, ...: the cache holds
    only the tokens so far; docs/inference.md); documents=True adds the documents rule (then
    every call takes document_ids, one per new token). block: the placement block (tokens).
    max_tokens_per_rank / max_bytes_per_rank: limits per rank (0: none; bytes count a page
    shared by forks once), checked for every rank before a call changes anything (ValueError
    naming the field); check_memory_limit: also refuse growth past this process's memory
    limit. device: "cpu" or "sim". bf16_tier:
    "exact" (default) or "fast" (bfloat16 caches: P rounded to bfloat16 before P V in prefill
    and decode, as GPU flash attention; its own accuracy rule, docs/kernel.md "bf16 tiers");
    float32 caches ignore it; every rank must pass the same (else the first prefill / decode
    raises ValueError naming it). hash_inputs: decode also has the ranks agree on a hash of
    q, k_new, v_new (ranks passing other queries are refused instead of merged; a pass over the
    inputs); None: the library's build default (on in a debug build). merge: how decode merges
    the ranks' partials, "allgather" (default), "chain" (the same bits) or "tree" (log2 P rounds
    of pairwise exchange, other bits); the same on every rank (docs/inference.md)."""

    def __init__(self, comm=None, *, kv_heads, head_dim, sequences=1, dtype="float32",
                 mask="causal", documents=False, block=64, threads=1, scale=None,
                 device="cpu", max_tokens_per_rank=0, max_bytes_per_rank=0,
                 check_memory_limit=True, bf16_tier="exact", hash_inputs=None,
                 merge="allgather"):
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
            comm, _whole("sequences", sequences, 0, _checks.MAX_BATCH),
            _whole("kv_heads", kv_heads, 1, _checks.MAX_HEADS),
            _whole("head_dim", head_dim, 1, 1 << 16), dtype, _whole("block", block, 1),
            text, _checks.threads(threads), _checks.scale(scale), str(device),
            _whole("max_tokens_per_rank", max_tokens_per_rank),
            float(max_bytes_per_rank), bool(check_memory_limit), _checks.bf16_tier(bf16_tier),
            None if hash_inputs is None else bool(hash_inputs), str(merge))
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.dtype, self.block, self.bf16_tier = dtype, block, bf16_tier

    # ---- slots: a server's requests come and go ---------------------------------------------
    # None of these communicate: every rank makes the same calls (the next prefill / decode
    # refuses ranks whose slot tables differ, naming the field). A refused call (ValueError)
    # changes nothing.
    @property
    def sequences(self):
        """Slots (live or free): indices are 0 .. sequences - 1."""
        return self._cache.slots()

    def live(self, seq):
        """Whether slot seq holds a sequence (False once freed)."""
        return self._cache.live(self._seq(seq))

    @property
    def live_sequences(self):
        """The live sequences, increasing: what decode() without seqs decodes, in that order."""
        return self._cache.live_sequences()

    def add(self):
        """A new empty sequence: the lowest free slot, else a new one. Returns its index."""
        return self._cache.add()

    def free(self, seq):
        """Ends sequence seq and gives its memory back; add() reuses the slot."""
        self._cache.free(self._seq(seq))

    def reset(self, seq):
        """Empties sequence seq (length 0), keeping it live; its pages are given back."""
        self._cache.reset(self._seq(seq))

    def truncate(self, seq, n):
        """Keeps the first n tokens of sequence seq (0 <= n <= tokens(seq)): rolls back
        rejected speculative tokens. The pages past token n's block are given back (a page a
        fork still holds stays for it)."""
        self._cache.truncate(self._seq(seq), _checks.whole("n", n, -(1 << 62), 1 << 62))

    def fork(self, seq, n=None):
        """A new sequence holding the first n tokens (None: all) of sequence seq; returns its
        index (add()'s slot). It shares their pages with seq (no K/V row is copied; a page is
        copied when one of its sequences writes into it while another holds it), so n
        samples of a prompt hold the prompt once. Checked against the limits like an append
        (max_tokens_per_rank counts the fork's tokens; max_bytes_per_rank a shared page once)."""
        return self._cache.fork(self._seq(seq), -1 if n is None else _whole("n", n))

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
        """Each slot's length, None for a free one."""
        return [self._cache.tokens(s) if self._cache.live(s) else None
                for s in range(self.sequences)]

    def local_tokens(self, seq=0):
        """Tokens of sequence seq this rank holds."""
        return self._cache.local_tokens(self._seq(seq))

    def local_positions(self, seq=0):
        """Global positions of the tokens of sequence seq this rank holds (increasing)."""
        return self._cache.local_positions(self._seq(seq))

    @property
    def nbytes(self):
        """Bytes of this rank's pages now (one per placement block it holds; a page shared by
        forks once; reserved pages included)."""
        return self._cache.bytes()

    def bytes_for(self, lengths, rank=None):
        """Bytes rank `rank` (default this one) needs for `lengths` tokens per sequence, in
        whole blocks (pages), no page shared: the arithmetic the limits use."""
        return self._cache.bytes_for(self._lengths(lengths), self.rank if rank is None else
                                     _whole("rank", rank, 0, self.ranks - 1))

    @property
    def token_bytes(self):
        """One token's k + v + position (+ document id) in the cache."""
        return self._cache.token_bytes()

    def reserve(self, lengths):
        """Makes the pages for `lengths` tokens per slot at once (0 for a free slot; checked
        like an append), so that growing to them takes no more memory."""
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
        rank. Collective.

        Several prompts of any lengths in one call: q, k, v (and document_ids) lists with one
        [1, T_i, H, D] entry per sequence of the list seq; returns the lists of out and lse.
        All are checked before any is stored: one bad prompt refuses the call."""
        several = isinstance(seq, (list, tuple))
        seqs = [self._seq(s) for s in seq] if several else [self._seq(seq)]
        qs, ks, vs = (list(x) if several else [x] for x in (q, k, v))
        ids = (list(document_ids) if several and document_ids is not None else
               [document_ids] * len(seqs) if document_ids is None else [document_ids])
        for name, xs in (("q", qs), ("k", ks), ("v", vs), ("document_ids", ids)):
            if len(xs) != len(seqs):
                raise ValueError(f"{name}: give one per sequence of seq ({len(seqs)}), got "
                                 f"{len(xs)}")
        ts, outs, lses = [], [], []
        for i, (qi, ki, vi) in enumerate(zip(qs, ks, vs)):
            t = Tensors({"q": qi, "k": ki, "v": vi})
            check_attention_shapes(t["q"], t["k"], t["v"])
            B, T, Hq, D = t["q"].shape
            if B != 1:
                where = f"q[{i}]" if several else "q"
                raise ValueError(
                    f"{where}: prefill takes one prompt [1, T, Hq, D] per sequence, got a batch "
                    f"of {B}; for several prompts (of any lengths) pass lists q=[...], k=[...], "
                    f"v=[...] and seq=[...] (one entry each)")
            ts.append(t)
            outs.append(t.empty(t["q"].shape))
            lses.append(t.empty((1, Hq, T), like_dtype=False))
        self._cache.prefill(seqs, [t["q"] for t in ts], [t["k"] for t in ts],
                            [t["v"] for t in ts], outs, lses, self._mode(mode),
                            [self._ids(x) for x in ids])
        outs = [t.restore(o) for t, o in zip(ts, outs)]
        if not several:
            return (outs[0], lses[0]) if return_lse else outs[0]
        return (outs, lses) if return_lse else outs

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

    def decode(self, q, k_new, v_new, document_ids=None, return_lse=True, seqs=None):
        """Tn new tokens of each of the sequences `seqs` at once (None: every live sequence,
        in slot order; else any distinct live ones, in q's order: continuous batching),
        sequences of any lengths: q [B, Tn, Hq, D], k_new, v_new [B, Tn, Hkv, D], B =
        len(seqs), the same on every rank. Appends their K/V (each on the rank the rule names),
        attends over the whole cache and merges the ranks' partials in rank order: out [B, Tn,
        Hq, D] and lse [B, Hq, Tn] bitwise the same on every rank, and the same whatever was
        prefilled before. document_ids: B * Tn ids (row-major) with the documents rule.
        Collective."""
        t = Tensors({"q": q, "k_new": k_new, "v_new": v_new})
        check_attention_shapes(t["q"], t["k_new"], t["v_new"])
        B, Tn, Hq, D = t["q"].shape
        out, lse = t.empty(t["q"].shape), t.empty((B, Hq, Tn), like_dtype=False)
        ids = None if document_ids is None else int_array(
            _flat(document_ids), "document_ids", "int32")
        if seqs is not None:
            seqs = [_whole("seqs[]", s) for s in seqs]
        self._cache.decode(t["q"], t["k_new"], t["v_new"], out, lse, ids, seqs)
        out = t.restore(out)
        return (out, lse) if return_lse else out

    # ---- checks -----------------------------------------------------------------------------
    def _seq(self, seq):
        return _checks.whole("seq", seq, 0, max(self.sequences - 1, 0),
                             "a slot of the cache; add() makes one")

    def _lengths(self, lengths):
        lengths = [int(n) for n in lengths]
        if len(lengths) != self.sequences:
            raise ValueError(f"lengths: expected one length per slot ({self.sequences}), "
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

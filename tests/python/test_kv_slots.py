"""ctxpar.KVCache as a server uses it (issue 39): add / free / reset, decode of any subset of
the live sequences, several prompts of different lengths in one prefill, truncate and fork,
each against the fp64 reference of whole-sequence attention (inference_case.reference, the
project's accuracy rule); refused calls leave the cache as it was; examples/python/serve.py
gives one process's tokens on 2 ranks (threads, torchrun). docs/faults.md, "A cache a server
can use"."""
import os
import re
import sys

import pytest
import torch

import ctxpar
import inference_case as case
from conftest import TORCHRUN, check_close, torchrun
from test_inference import on_threads

SERVE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples",
                     "python", "serve.py")
POOL = case.whole_problem([300], seed=3)[0]  # q, k, v rows every sequence draws from


class Truth:
    """What each slot should hold: rows of POOL, drawn in order."""

    def __init__(self):
        self.rows, self.next = {}, 0

    def fresh(self, n):
        r = list(range(self.next, self.next + n))
        self.next += n
        return r

    def qkv(self, rows):
        return [x[:, rows] for x in POOL[:3]]

    def check(self, seq, got, last):
        """got [1, m, Hq, D]: the last m rows of sequence seq against the reference."""
        q, k, v = self.qkv(self.rows[seq])
        ok = case.mask_rule("causal", q.shape[1], None)
        n = q.shape[1]
        check_close(f"sequence {seq}", got,
                    case.reference(q, k, v, ok, torch.float64)[:, n - last:],
                    case.reference(q, k, v, ok, torch.float32)[:, n - last:])


def prefill(cache, truth, seqs, lengths):
    added = [truth.fresh(n) for n in lengths]
    parts = [truth.qkv(r) for r in added]
    outs, _ = cache.prefill([p[0] for p in parts], [p[1] for p in parts], [p[2] for p in parts],
                            seq=seqs)
    for s, r, out in zip(seqs, added, outs):
        truth.rows.setdefault(s, []).extend(r)
        truth.check(s, out, len(r))


def decode(cache, truth, seqs, tn=1):
    added = [truth.fresh(tn) for _ in seqs]
    q, k, v = (torch.cat(x) for x in zip(*[truth.qkv(r) for r in added]))
    out, _ = cache.decode(q, k, v, seqs=seqs)
    for i, (s, r) in enumerate(zip(seqs, added)):
        truth.rows[s].extend(r)
        truth.check(s, out[i:i + 1], tn)
        assert cache.tokens(s) == len(truth.rows[s])


@pytest.mark.parametrize("ranks,merge", [(1, "allgather"), (2, "allgather"), (3, "chain"),
                                         (3, "tree")])
def test_a_servers_calls_match_the_reference(ranks, merge):
    def fn(comm):
        cache = ctxpar.KVCache(comm, kv_heads=2, head_dim=16, sequences=0, block=8, merge=merge)
        truth = Truth()
        a, b = cache.add(), cache.add()
        prefill(cache, truth, [a, b], [19, 33])  # one call, two lengths
        decode(cache, truth, [b, a], tn=2)
        decode(cache, truth, [b])  # a subset
        cache.free(a)
        assert cache.live_sequences == [b] and cache.lengths == [None, 36]
        c = cache.add()
        assert c == a  # the freed slot is reused
        truth.rows[c] = []
        prefill(cache, truth, [c], [11])
        decode(cache, truth, [b, c], tn=3)  # a draft of 3 tokens, 2 rejected
        cache.truncate(b, cache.tokens(b) - 2)
        del truth.rows[b][-2:]
        d = cache.fork(b, 20)
        truth.rows[d] = truth.rows[b][:20]
        e = cache.fork(c)
        truth.rows[e] = list(truth.rows[c])
        decode(cache, truth, [e, d, c, b])
        cache.reset(c)
        truth.rows[c] = []
        prefill(cache, truth, [c], [6])
        decode(cache, truth, cache.live_sequences)
        return cache.sequences

    assert on_threads(ranks, fn) == [4] * ranks


def test_forks_share_their_parents_pages():
    """fork() shares the prefix's pages copy-on-write (docs/inference.md, "Paged storage"):
    8 forks take no memory, and their first tokens copy only the page they write into (block
    3 of 8 tokens: tokens 24..31), on the rank that holds it; the parent keeps its rows."""
    def fn(comm):
        cache = ctxpar.KVCache(comm, kv_heads=2, head_dim=16, sequences=0, block=8)
        truth = Truth()
        a = cache.add()
        prefill(cache, truth, [a], [30])
        before = cache.nbytes
        forks = [cache.fork(a) for _ in range(8)]
        grown = [cache.nbytes - before]
        for f in forks:
            truth.rows[f] = list(truth.rows[a])
        decode(cache, truth, forks)  # each against its own whole sequence's reference
        grown.append(cache.nbytes - before)
        decode(cache, truth, [a])  # the parent: its rows as they were
        page = 8 * cache.token_bytes
        return grown == [0, 8 * page if cache.rank == 3 % cache.ranks else 0]

    assert on_threads(2, fn) == [True, True]


def snapshot(cache):
    live = cache.live_sequences
    return (cache.sequences, cache.lengths, cache.nbytes,
            [cache.local_positions(s) for s in live])


def two_tokens():
    """q, k, v of one new token of each of two sequences: [2, 1, H, D]."""
    return [x.reshape(2, 1, *x.shape[2:]) for x in Truth().qkv([0, 1])]


@pytest.mark.parametrize("prepare, call, message", [
    (None, lambda c: c.free(1), r"sequence 1 is free \(freed, or never added\): add\(\) a "
                                r"sequence"),
    (None, lambda c: c.fork(1), r"sequence 1 is free"),
    (None, lambda c: c.fork(0, 21), r"fork: sequence 0 has 20 tokens; a fork keeps at most all"),
    (lambda c: c.fork(0, 5), lambda c: c.fork(1, 6), r"fork: sequence 1 has 5 tokens"),
    (None, lambda c: c.truncate(2, -1), r"truncate: sequence 2 has 9 tokens; keep n in 0\.\.9 "
                                        r"of them, got -1"),
    (None, lambda c: c.decode(*two_tokens(), seqs=[0, 1]),
     r"decode: invalid arguments on rank 0, 1 \(of 2\): sequence 1 is free"),
    (None, lambda c: c.decode(*two_tokens(), seqs=[2, 2]), r"seqs: sequence 2 is named twice"),
])
def test_a_refused_call_changes_nothing(prepare, call, message):
    def fn(comm):
        cache = ctxpar.KVCache(comm, kv_heads=2, head_dim=16, sequences=3, block=8)
        for s, n in enumerate([20, 14, 9]):
            cache.append(*Truth().qkv(list(range(n)))[1:], seq=s)
        cache.free(1)
        if prepare:
            prepare(cache)  # a fork of a fork: the first one takes the free slot 1
        before = snapshot(cache)
        with pytest.raises(ValueError, match=message):
            call(cache)
        return snapshot(cache) == before

    assert on_threads(2, fn) == [True, True]


def test_a_batch_to_prefill_is_refused_on_every_rank_naming_the_way():
    # Before: rank 0 cut the [2, 10, ...] batch row by row ("copy: shape [2, 1, 4, 16] does not
    # match [1, 1, 4, 16]", an internal error) while rank 1, with no row of these 10 tokens,
    # waited in prefill's agreement for a rank that had returned.
    def fn(comm):
        cache = ctxpar.KVCache(comm, kv_heads=2, head_dim=16, sequences=2, block=16)
        q, k, v = (x.reshape(2, 10, *x.shape[2:]) for x in Truth().qkv(list(range(20))))
        with pytest.raises(ValueError, match=r"q: prefill takes one prompt \[1, T, Hq, D\] per "
                                             r"sequence, got a batch of 2; .* pass lists"):
            cache.prefill(q, k, v)
        # The binding given the batch itself refuses it on every rank, in the agreement.
        out, lse = torch.empty(2, 10, 4, 16), torch.empty(2, 4, 10)
        with pytest.raises(ValueError, match=r"prefill: invalid arguments on rank 0, 1 \(of 2\): "
                                             r"q: expected shape"):
            cache._cache.prefill([0], [q], [k], [v], [out], [lse], "auto", [None])
        return cache.lengths

    assert on_threads(2, fn) == [[0, 0], [0, 0]]


def test_ranks_with_other_queries_are_refused_when_inputs_are_hashed():
    def fn(comm):
        cache = ctxpar.KVCache(comm, kv_heads=2, head_dim=16, block=8, hash_inputs=True)
        q, k, v = Truth().qkv([comm.rank])
        with pytest.raises(ValueError, match=r"q, k_new, v_new \(a hash of their values\) is"):
            cache.decode(q, k, v)
        return cache.lengths

    assert on_threads(2, fn) == [[0], [0]]


# 5 requests through 2 slots, one layer: small enough for CI, and still every slot reused.
SMALL = ["--prompts", "13,5,21,8,11", "--new-tokens", "3,6,2,4,3", "--slots", "2",
         "--layers", "1"]


def assert_same_tokens(stdout, ranks, transport):
    assert f"ranks {ranks} ({transport}), 5 requests" in stdout, stdout
    # 2 slots for 5 requests: the later ones get freed slots back.
    given = eval(re.search(r"slots given in turn: (\[.*\])", stdout).group(1))
    assert len(given) == 5 and set(given) == {0, 1}, stdout
    for r in range(5):
        spread = re.search(rf"request {r} spread: (\[.*\])", stdout).group(1)
        whole = re.search(rf"request {r} whole:  (\[.*\])", stdout).group(1)
        assert spread == whole, stdout
    assert "same tokens as one rank with the whole cache" in stdout


def test_serve_on_two_threads(monkeypatch, capsys):
    # In this process (torch is loaded already): the example's main with 2 rank threads.
    sys.path.insert(0, os.path.dirname(SERVE))
    import serve
    monkeypatch.setattr(sys, "argv", ["serve.py", *SMALL, "--threads", "2"])
    with pytest.raises(SystemExit) as e:
        serve.main()
    out = capsys.readouterr().out
    assert e.value.code == 0, out
    assert_same_tokens(out, 2, "threads")


@pytest.mark.skipif(TORCHRUN is None or not ctxpar._distributed.gloo_available(),
                    reason="needs the venv's torchrun and ctxpar's gloo transport")
def test_serve_under_torchrun_2():
    run = torchrun(2, SERVE, *SMALL, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert_same_tokens(run.stdout, 2, "gloo")


def test_a_merge_that_is_not_one_is_named():
    with pytest.raises(ValueError, match="merge: unknown decode merge 'ring'; valid: allgather, "
                                         "chain, tree"):
        on_threads(1, lambda comm: ctxpar.KVCache(comm, kv_heads=1, head_dim=16, merge="ring"))

"""ctxpar.KVCache (python/ctxpar/inference.py): prefill and decode with the cache spread over
ranks, against the fp64 SDPA of the whole sequence on one rank (inference_case.py), under
threads, mpirun and torchrun; decode bitwise independent of how the context was cut into
prefill calls; memory reporting and limits; forced prefill modes."""
import os

import pytest
import torch

import ctxpar
from ctxpar.inference import predict_prefill_bytes
from conftest import MPIRUN, TORCHRUN, mpirun, torchrun
import inference_case as case

HERE = os.path.dirname(os.path.abspath(__file__))
CASE = os.path.join(HERE, "inference_case.py")


def on_threads(ranks, fn):
    results = [None] * ranks

    def body(comm):
        results[comm.rank] = fn(comm)

    ctxpar.run_threads(ranks, body, timeout_s=60)
    return results


@pytest.mark.parametrize("ranks", [1, 2, 3])
@pytest.mark.parametrize("mask", ["causal", "causal+window:12,0", "causal+documents"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_and_batched_decode_match_the_fp64_reference(ranks, mask, dtype):
    results = on_threads(ranks, lambda comm: case.run(comm, mask, dtype)[:3])
    rows, ran, seqs = results[0]
    case.check(rows, seqs, mask, dtype)
    assert ran == ["pass-kv", "pass-q", "pass-kv"]
    for r in range(1, ranks):  # whole outputs, the same bits on every rank
        for a, b in zip(rows, results[r][0]):
            assert torch.equal(a, b), f"rank {r} differs from rank 0"


@pytest.mark.parametrize("ranks", [2, 3])
def test_decode_is_bitwise_independent_of_how_the_context_was_prefilled(ranks):
    def decoded(cuts, modes):
        def fn(comm):
            rows, _, _, _ = case.run(comm, "causal", torch.float32, modes=modes, cuts=cuts,
                                     decode_steps=5)
            return [r[:, -5:] for r in rows]
        return on_threads(ranks, fn)[0]

    base = decoded(((57,), (23,)), ("pass-kv",))
    for cuts, modes in [(((40, 17), (23,)), ("pass-q",)), (((1, 30, 26), (8, 15)), ("auto",)),
                        (((56, 1), (22, 1)), ("pass-kv", "pass-q"))]:
        for a, b in zip(base, decoded(cuts, modes)):
            assert torch.equal(a, b), f"decode differs after prefilling in pieces {cuts}"


def test_auto_picks_the_mode_that_moves_fewer_bytes_and_stats_count_them():
    def fn(comm):
        cache = ctxpar.KVCache(comm, kv_heads=1, head_dim=16, block=8)
        q, k, v, _ = case.whole_problem([520], Hq=2, Hkv=1)[0]
        got = {}
        for name, sl in (("long", slice(0, 512)), ("short", slice(512, 520))):
            cache.prefill(q[:, sl], k[:, sl], v[:, sl])
            st = cache.last_stats
            got[name] = (st["mode"], st["bytes_sent"])
        return got

    results = on_threads(2, fn)
    p0 = predict_prefill_bytes(0, 512, 2, heads=2, kv_heads=1, head_dim=16, block=8)
    p1 = predict_prefill_bytes(512, 8, 2, heads=2, kv_heads=1, head_dim=16, block=8)
    assert p0["auto"] == "pass-kv" and p1["auto"] == "pass-q", (p0, p1)
    assert results[0]["long"][0] == "pass-kv" and results[0]["short"][0] == "pass-q"
    for which, p in (("long", p0), ("short", p1)):
        sent = sum(r[which][1] for r in results)
        assert sent == p[p["auto"]], (which, sent, p)


def test_memory_is_reported_and_limits_refuse_naming_the_field():
    def fn(comm):
        cache = ctxpar.KVCache(comm, kv_heads=2, head_dim=16, block=8, max_tokens_per_rank=40)
        assert cache.token_bytes == 2 * 2 * 16 * 4 + 8
        cache.reserve([64])
        assert cache.nbytes == cache.bytes_for([64]) == 32 * cache.token_bytes
        k = torch.zeros(1, 64, 2, 16)
        cache.append(k, k)
        assert cache.local_tokens() == 32 and cache.tokens() == 64
        assert cache.local_positions() == [i for i in range(64) if (i // 8) % 2 == comm.rank]
        assert cache.placement(60, 8, 1) == [60, 61, 62, 63] and cache.rank_of(64) == 0
        with pytest.raises(ValueError, match="max_tokens_per_rank"):
            cache.append(torch.zeros(1, 32, 2, 16), torch.zeros(1, 32, 2, 16))
        assert cache.tokens() == 64  # nothing changed
        return True

    assert on_threads(2, fn) == [True, True]


def test_bad_arguments_are_refused_naming_them():
    def fn(comm):
        with pytest.raises(ValueError, match="dtype"):
            ctxpar.KVCache(comm, kv_heads=1, head_dim=16, dtype="float16")
        cache = ctxpar.KVCache(comm, kv_heads=2, head_dim=16)
        q = torch.zeros(1, 4, 4, 16)
        with pytest.raises(ValueError, match="mode"):
            cache.prefill(q, q[:, :, :2], q[:, :, :2], mode="pass-x")
        with pytest.raises(ValueError, match="seq"):
            cache.prefill(q, q[:, :, :2], q[:, :, :2], seq=1)
        with pytest.raises(ValueError, match="kv_heads|Hkv|k"):
            cache.decode(torch.zeros(1, 1, 4, 16), torch.zeros(1, 1, 4, 16),
                         torch.zeros(1, 1, 4, 16))
        return True

    assert on_threads(1, fn) == [True]


@pytest.mark.skipif(MPIRUN is None, reason="mpirun not found (apt install openmpi-bin)")
def test_kv_cache_under_mpirun():
    run = mpirun(2, CASE, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    for r in range(2):
        assert f"rank {r} of 2: mpi ok" in run.stdout, run.stdout


@pytest.mark.skipif(TORCHRUN is None, reason="no torchrun beside the python")
@pytest.mark.skipif(not ctxpar._distributed.gloo_available(),
                    reason="ctxpar built without its gloo transport")
def test_kv_cache_under_torchrun():
    run = torchrun(2, CASE, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    for r in range(2):
        assert f"rank {r} of 2: gloo ok" in run.stdout, run.stdout

"""The ranks' agreement is one function, the library's (include/ctxpar/agreement.h): cp_attention
refuses disagreeing ranks with exactly the text the strategies and tests/comm/agreement_test.cc
give for the same mismatch."""
import pytest
import torch

import ctxpar
from ctxpar import _ctxpar
from ctxpar import layout as cl
from ctxpar.torch import cp_attention
from conftest import problem

T = 32
WANT = ("cp_attention: the ranks were called with different arguments: layout is zigzag on "
        "rank 0 but striped on rank 1; every rank of the communicator must pass the same")


def test_agreement_is_the_librarys():
    q, k, v, _ = (torch.from_numpy(x) for x in problem(T=T))
    results = [None, None]

    def rank(comm):
        layout = "zigzag" if comm.rank == 0 else "striped"
        with pytest.raises(ValueError) as direct:
            _ctxpar._require_agreement(comm, "cp_attention", [("layout", layout)])
        local = [cl.shard(x, comm, layout=layout, seq_dim=1) for x in (q, k, v)]
        with pytest.raises(ValueError) as via_torch:
            cp_attention(*local, comm, layout=layout)
        results[comm.rank] = (str(direct.value), str(via_torch.value))

    ctxpar.run_threads(2, rank, timeout_s=60)
    for direct, via_torch in results:
        assert direct == WANT
        assert via_torch == WANT


def test_a_local_error_names_the_ranks():
    results = [None] * 3

    def rank(comm):
        with pytest.raises(ValueError) as info:
            _ctxpar._require_agreement(comm, "call", [("seq", "8")],
                                       "bad q" if comm.rank == 2 else "")
        results[comm.rank] = str(info.value)

    ctxpar.run_threads(3, rank, timeout_s=60)
    assert results == ["call: invalid arguments on rank 2 (of 3): bad q"] * 3

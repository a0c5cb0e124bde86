"""Communicator.from_torch hands every rank's gloo address, as all_gather_object returned it, to
the C++ bootstrap, which checks each address on its own (the cases are in
tests/gloo/tcp_store_test.cc): a crafted one is a ValueError naming the rank, never a read past
its end. torch.distributed is stood in for (one process plays rank 0 of 3)."""
import struct

import pytest

import ctxpar
from ctxpar import _ctxpar

pytestmark = pytest.mark.skipif(not ctxpar._distributed.gloo_available(),
                                reason="ctxpar built without its gloo transport")
torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")


def stand_in_for_torch(monkeypatch, size, gathered):
    """torch.distributed as rank 0 of `size` whose all_gather_object returns `gathered`
    (rank 0's own address in place of its None)."""
    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: size)

    def all_gather_object(out, mine, group=None):
        out[:] = [mine] + gathered[1:]

    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)


def with_entry_size(address, size, entry):
    """The address rebuilt with entries of `entry` bytes, consistent in itself."""
    real = struct.unpack_from("<I", address, 16)[0]
    entries = b"".join(address[20 + k * real:20 + k * real + entry].ljust(entry, b"\0")
                       for k in range(size - 1))
    return address[:16] + struct.pack("<I", entry) + entries + address[20 + real * (size - 1):]


def test_from_torch_refuses_a_crafted_address_naming_the_rank(monkeypatch):
    peers = [_ctxpar._GlooBootstrap(r, 3, 2000) for r in (1, 2)]
    real = [None] + [p.address() for p in peers]
    crafted = [None, with_entry_size(real[1], 3, 8), real[2]]
    stand_in_for_torch(monkeypatch, 3, crafted)
    with pytest.raises(ValueError, match=r"addresses\[1\] has entries of 8 bytes, where this "
                                         r"build's are \d+"):
        ctxpar.Communicator.from_torch(None, timeout_s=2)
    crafted = [None, real[1], b"CTXPARG1" + struct.pack("<II", 2, 3)]  # cut after the header
    stand_in_for_torch(monkeypatch, 3, crafted)
    with pytest.raises(ValueError, match=r"addresses\[2\] is truncated \(16 bytes, where its "
                                         r"header alone is 20\)"):
        ctxpar.Communicator.from_torch(None, timeout_s=2)
    stand_in_for_torch(monkeypatch, 3, [None, real[1], "not bytes"])
    with pytest.raises(TypeError):
        ctxpar.Communicator.from_torch(None, timeout_s=2)


def test_from_torch_refuses_a_group_past_the_bound(monkeypatch):
    stand_in_for_torch(monkeypatch, 5000, [None] * 5000)
    with pytest.raises(ValueError, match=r"size must be in \[1, 1024\]"):
        ctxpar.Communicator.from_torch(None, timeout_s=2)


def test_the_address_variables_reach_the_bootstrap(monkeypatch):
    """The library reads no environment: the extension reads CTXPAR_GLOO_IFNAME / _HOST and
    passes them to the C++ bootstrap. A host that does not resolve is refused naming it."""
    monkeypatch.setenv("CTXPAR_GLOO_IFNAME", "")
    monkeypatch.setenv("CTXPAR_GLOO_HOST", "no-such-host.invalid")
    with pytest.raises(_ctxpar.Error, match="cannot listen on host 'no-such-host.invalid'"):
        _ctxpar._GlooBootstrap(0, 2, 2000)
    monkeypatch.delenv("CTXPAR_GLOO_HOST")
    assert _ctxpar._GlooBootstrap(0, 2, 2000).address().startswith(b"CTXPARG1")

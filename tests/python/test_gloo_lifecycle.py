"""How a process with ctxpar's gloo communicators ends (issue 38): every ending of a torchrun
job exits 0 (gloo_lifecycle_case.py runs them, each run a process of its own), from_torch
makes one communicator per group, ctxpar closes its communicators at exit (close()), torch's
GLOO_SOCKET_IFNAME chooses the interface, and a failing rank's error file lets torchrun's
summary name it (test_torchrun.py's raising job checks the summary)."""
import os
import re
import socket

import pytest

import ctxpar
from ctxpar import _ctxpar
from conftest import TORCHRUN, torchrun

HERE = os.path.dirname(os.path.abspath(__file__))
CASE = os.path.join(HERE, "gloo_lifecycle_case.py")
pytestmark = pytest.mark.skipif(not ctxpar._distributed.gloo_available(),
                                reason="ctxpar built without its gloo transport")
# Runs of each ending per test. Each run is a process exit (~0.6 s idle, 3 s on the loaded
# 2-core CI machine: most of it the interpreter's teardown of torch's modules), so CI runs one;
# CTXPAR_LIFECYCLE_RUNS=20 is the stress run of the issue (docs/faults.md gives its result).
RUNS = int(os.environ.get("CTXPAR_LIFECYCLE_RUNS", "1"))


@pytest.mark.skipif(TORCHRUN is None, reason="no torchrun beside the python")
def test_every_ending_of_a_torchrun_job_exits_0():
    run = torchrun(2, CASE, "destroy,del,nothing,loop", str(RUNS), timeout=120 + 30 * RUNS)
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    for r in range(2):
        assert f"rank {r}: 0 of {4 * RUNS} runs failed" in run.stdout, run.stdout


def test_close_lets_go_and_later_use_is_refused():
    comm = ctxpar._distributed.world_of_one(5)
    assert not comm.closed and comm.size == 1
    comm.close()
    assert comm.closed
    with pytest.raises(ValueError, match=r"communicator: closed \(by close\(\), or by ctxpar "
                                         r"at the interpreter's exit\)"):
        comm.barrier()
    comm.close()  # idempotent
    assert _ctxpar._gloo_failed_rank(comm) == -1


def listen_text(address):
    """A GlooBootstrap address as text: its last field is Gloo's description of the device
    (`tcp, pci=, iface=eth0, speed=-1, addr=[192.0.2.2]`)."""
    return address.decode("latin-1")


def test_gloo_socket_ifname_chooses_the_interface_and_a_missing_one_is_refused(monkeypatch):
    monkeypatch.delenv("CTXPAR_GLOO_IFNAME", raising=False)
    monkeypatch.delenv("CTXPAR_GLOO_HOST", raising=False)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "ctxpar-no-if0")
    with pytest.raises(_ctxpar.Error, match=r"GLOO_SOCKET_IFNAME=ctxpar-no-if0: this host has no "
                                            r"network interface 'ctxpar-no-if0' \(it has: .*lo"):
        _ctxpar._GlooBootstrap(0, 2, 2000)
    # torch's form: a list, of which ctxpar's one device takes the first
    for name in [n for _, n in socket.if_nameindex()]:
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", f"{name},ctxpar-no-if0")
        try:
            text = listen_text(_ctxpar._GlooBootstrap(0, 2, 2000).address())
        except _ctxpar.Error as e:  # an interface without an address (down): Gloo's words
            assert name in str(e), e
            continue
        assert re.search(rf"iface={re.escape(name)}\b", text), (name, text)
    # CTXPAR_GLOO_IFNAME, ctxpar's own, comes first
    monkeypatch.setenv("CTXPAR_GLOO_IFNAME", "lo")
    assert "iface=lo" in listen_text(_ctxpar._GlooBootstrap(0, 2, 2000).address())

"""CUDA tensors through DLPack (issue 23): tensors whose __dlpack_device__() is kDLCUDA (2) are
routed to ctxpar's cuda device. Where it cannot take them (this package is built without CUDA;
a CUDA build on a machine without a GPU: "no CUDA device found ...") the error names the
argument and the reason; a mix of CUDA and CPU tensors is refused naming each one's device.
The objects here only say they live on CUDA: ctxpar must refuse before reading any memory."""
import numpy as np
import pytest
import torch

import ctxpar
from ctxpar import _ctxpar
from ctxpar.torch import cp_attention
from conftest import problem


class OnCuda:
    """Looks like a CUDA tensor to DLPack (device (2, index)) and to the shape checks."""

    def __init__(self, like, index=0):
        self.shape, self.dtype, self.ndim = like.shape, like.dtype, like.ndim
        self.index = index

    def __dlpack_device__(self):
        return (2, self.index)

    def __dlpack__(self, stream=None):
        raise AssertionError("ctxpar read a CUDA tensor's memory instead of refusing it")


def reason():
    return _ctxpar._cuda_unavailable()


def test_cuda_tensors_are_routed_to_the_cuda_device_which_says_why_it_cannot_run():
    q, k, v, dout = problem(T=16)
    assert reason().startswith("this ctxpar was built without CUDA: ") or \
        reason().startswith("no CUDA device found")
    expect = "q is a CUDA tensor; " + reason()
    with pytest.raises(RuntimeError) as e:
        ctxpar.attention(OnCuda(q), OnCuda(k), OnCuda(v), ranks=2)
    assert str(e.value) == expect
    with pytest.raises(RuntimeError) as e:
        ctxpar.attention_backward(*(OnCuda(x) for x in (q, k, v, q)), OnCuda(q[:, :, :, 0]),
                                  OnCuda(dout))
    assert str(e.value) == expect

    def on_rank(comm):
        with pytest.raises(RuntimeError) as e:
            cp_attention(OnCuda(q), OnCuda(k), OnCuda(v), comm=comm)
        assert str(e.value) == expect

    ctxpar.run_threads(1, on_rank)


def test_built_without_cuda_says_so():
    # The Python package is built with CTXPAR_CUDA=OFF (pyproject.toml).
    assert reason().startswith("this ctxpar was built without CUDA: ")
    assert "CTXPAR_CUDA=OFF" in reason() and ".cpu()" in reason()


def test_cuda_and_cpu_tensors_mixed_are_refused_naming_both():
    q, k, v, _ = problem(T=16)
    with pytest.raises(TypeError, match=r"^tensors on different devices: q on cpu, k on cuda:0, "
                                        r"v on cpu; put them all on one device"):
        ctxpar.attention(q, OnCuda(k), v)
    with pytest.raises(TypeError, match=r"q on cuda:0, k on cuda:1, v on cuda:0"):
        ctxpar.attention(OnCuda(q), OnCuda(k, 1), OnCuda(v))

    def on_rank(comm):
        qt, kt, vt = (torch.from_numpy(x) for x in (q, k, v))
        with pytest.raises(TypeError, match=r"q on cuda:0, k on cpu, v on cpu"):
            cp_attention(OnCuda(qt), kt, vt, comm=comm)

    ctxpar.run_threads(1, on_rank)


def test_cpu_tensors_still_run():
    q, k, v, _ = problem(T=16)
    out, _ = ctxpar.attention(q, k, v, ranks=2)
    ref, _ = ctxpar.attention(q, k, v, ranks=1)
    assert np.abs(out - ref).max() < 1e-5

"""CUDA tensors through DLPack (issues 23, 24): tensors whose __dlpack_device__() is kDLCUDA (2)
are routed to ctxpar's cuda device. Where it cannot take them (this package is built without
CUDA; a CUDA build on a machine without a GPU: "no CUDA device found ...") the error names the
argument and the reason; a mix of CUDA and CPU tensors is refused naming each one's device.
The OnCuda objects here only say they live on CUDA: ctxpar must refuse before reading any
memory. Where the cuda device exists, the whole path runs: checked here without a GPU on the
test-only recording cuda device (cuda_recording_case.py, fake_cuda.py)."""
import os
import re
import shutil
import subprocess
import sys

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
        "no CUDA device found" in reason()
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


def nvcc_found():
    return bool(shutil.which("nvcc") or os.path.exists("/usr/local/cuda/bin/nvcc") or
                (os.environ.get("CUDA_HOME") and
                 os.path.exists(os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc"))))


@pytest.mark.skipif(not nvcc_found() or os.path.exists("/dev/nvidia0"),
                    reason="needs nvcc where the package was built and no GPU")
def test_built_with_cuda_where_nvcc_is_found_and_says_no_gpu():
    # pyproject.toml: CTXPAR_CUDA=AUTO; this machine has the toolkit but no GPU.
    assert "no CUDA device found" in reason(), reason()
    assert "cudaGetDeviceCount" in reason() and "libcuda.so.1" in reason()


@pytest.mark.skipif(not shutil.which("readelf"), reason="needs readelf")
def test_the_extension_loads_without_any_cuda_library():
    # A build with CUDA links the runtime statically (it finds libcuda.so.1 when a device is
    # asked for) and opens cuDNN / NCCL with dlopen: import ctxpar works without a driver.
    out = subprocess.run(["readelf", "-d", _ctxpar.__file__], capture_output=True, text=True,
                         timeout=60).stdout
    needed = re.findall(r"\(NEEDED\).*\[(.*)\]", out)
    assert needed, out
    assert not [n for n in needed if re.match(r"lib(cuda|cudart|cudnn|nccl|nvrtc)", n)], needed


def test_without_cuda_the_reason_names_the_build_option():
    if not reason().startswith("this ctxpar was built without CUDA: "):
        pytest.skip("built with CUDA")
    assert "CTXPAR_CUDA" in reason() and ".cpu()" in reason()


def test_the_cuda_path_on_the_recording_device_is_bitwise_the_cpu_device():
    # Its own process: the CPU side must use the scalar kernel (the recording API runs the
    # fallback kernel's tile math, bitwise CTXPAR_KERNEL=scalar), chosen once per process.
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, CTXPAR_KERNEL="scalar", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, os.path.join(here, "cuda_recording_case.py")],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout + r.stderr


def test_fake_cuda_tensors_meet_the_refusals_on_the_recording_device():
    from fake_cuda import on_fake_gpu, test_hooks
    q, k, v, dout = problem(T=16)
    qt, kt, vt = (torch.from_numpy(x) for x in (q, k, v))
    ref, ref_lse = ctxpar.attention(q, k, v, ranks=2, mask="causal")
    test_hooks()._testing_cuda_recording(True)
    try:
        with on_fake_gpu():
            with pytest.raises(TypeError, match=r"^tensors on different devices: q on cuda:0, "
                                                r"k on cpu, v on cuda:0"):
                ctxpar.attention(qt, k, vt)  # k: a NumPy array, on the CPU
            with pytest.raises(ValueError, match=r"q: T = 15 tokens of CUDA tensors cannot be "
                                                 r"cut into ranks=2 equal shards by the zigzag "
                                                 r"layout .*pad the sequence to 16 tokens"):
                ctxpar.attention(qt[:, :15], kt[:, :15], vt[:, :15], ranks=2)
            out, lse = ctxpar.attention(qt, kt, vt, ranks=2, mask="causal")
            # The strategies' checks read the device's memory through a copy the device makes:
            # a NaN is named as on the CPU.
            bad = qt.clone()
            bad[1, 9, 2, 3] = float("nan")
            with pytest.raises(ctxpar.Error) as on_gpu:
                ctxpar.attention(bad, kt, vt, ranks=2)
        # Same inputs, the fallback kernel's tile math against this process's CPU kernel
        # (bitwise only against the scalar one: the test above): the accuracy rule's scale.
        assert np.abs(out.numpy() - ref).max() < 1e-5 and np.abs(lse.numpy() - ref_lse).max() < 1e-5
        with pytest.raises(ctxpar.Error) as on_cpu:
            ctxpar.attention(bad, kt, vt, ranks=2)
        # (the CPU's whole-tensor runner adds "rank 1 failed: "; run_threads re-raises as is)
        assert "on rank 1 (of 2): q: non-finite value (nan) at token position 9, batch 1, " \
            "head 2, dim 3" in str(on_gpu.value)
        assert str(on_cpu.value).endswith(str(on_gpu.value))
    finally:
        _ctxpar._testing_cuda_recording(False)
        _ctxpar._testing_cuda_reports()


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

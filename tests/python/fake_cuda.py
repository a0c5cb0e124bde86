"""Fake CUDA tensors for the tests of the CUDA path on a machine without a GPU: inside
on_fake_gpu(), CPU torch tensors whose DLPack export says kDLCUDA (device (2, 0)), handed over
as real DLPack capsules built with ctypes. With the recording cuda device of the extension's
test build (test_hooks()._testing_cuda_recording(True): RecordingCudaApi, whose "device memory"
is host memory) ctxpar then runs the whole CUDA path on them: routing, outputs allocated on the
inputs' device, autograd's backward, the device taking the memory in place."""
import contextlib
import ctypes

import torch


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


_CODES = {torch.float32: (2, 32), torch.float16: (2, 16), torch.bfloat16: (4, 16),
          torch.int32: (0, 32), torch.int64: (0, 64)}
_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_kept = []  # the structures a capsule points at, kept for the whole test process
exports = []  # (data pointer, nbytes) of every capsule made, for the tests


def _export(self, *, stream=None, max_version=None, dl_device=None, copy=None):
    """torch.Tensor.__dlpack__ while on_fake_gpu(): a capsule whose device is (kDLCUDA, 0)."""
    n = self.dim()
    shape = (ctypes.c_int64 * max(n, 1))(*self.shape)
    strides = (ctypes.c_int64 * max(n, 1))(*self.stride())
    code, bits = _CODES[self.dtype]
    m = _DLManagedTensor()
    m.dl_tensor = _DLTensor(self.data_ptr(), _DLDevice(2, 0), n, _DLDataType(code, bits, 1),
                            shape, strides, 0)
    _kept.append((m, shape, strides, self))
    exports.append((self.data_ptr(), self.numel() * self.element_size()))
    return _capsule_new(ctypes.addressof(m), b"dltensor", None)


@contextlib.contextmanager
def on_fake_gpu():
    """While inside, every torch tensor says it lives on cuda:0 (__dlpack_device__ (2, 0)) and
    exports itself so: outputs torch allocates (new_empty, empty_like), shards, saved tensors
    in autograd's backward, all. Patches torch.Tensor for the whole process: for a test's own
    process, or one test at a time."""
    saved = torch.Tensor.__dlpack__, torch.Tensor.__dlpack_device__
    torch.Tensor.__dlpack__ = _export
    torch.Tensor.__dlpack_device__ = lambda self: (2, 0)
    try:
        yield
    finally:
        torch.Tensor.__dlpack__, torch.Tensor.__dlpack_device__ = saved


def test_hooks():
    """The extension, with the test hooks of a test build (python/bindings/testing.h); a failure
    saying how to get one where the installed package has none (a user's `pip install .`)."""
    from ctxpar import _ctxpar
    assert hasattr(_ctxpar, "_testing_cuda_recording"), (
        "this ctxpar was built without its test hooks: install a test build with "
        "pip install --no-build-isolation -C cmake.define.CTXPAR_PYTHON_TESTING=ON . "
        "(scripts/test.sh does)")
    return _ctxpar

"""Arguments at the boundary: which framework a tensor comes from, checks that name the
argument, and outputs allocated in the caller's framework (so results come back as the same
kind of tensor, written in place by C++ through DLPack)."""
import sys

import numpy as np


def framework(x, name):
    """'numpy' or 'torch'; TypeError for anything else."""
    if isinstance(x, np.ndarray):
        return "numpy"
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return "torch"
    raise TypeError(f"{name}: expected a NumPy array or a torch tensor, got {type(x).__name__}")


def dtype_name(x):
    """'float32' | 'bfloat16' | 'float16' | ... for either framework."""
    return str(x.dtype).replace("torch.", "")


def device_of(x):
    return str(x.device) if hasattr(x, "device") and not isinstance(x, np.ndarray) else "cpu"


_SUPPORTED = ("float32", "bfloat16", "float16")

# DLPack's device types (dlpack.h, DLDeviceType) by number.
_KDL_CPU, _KDL_CUDA = 1, 2
_DLPACK_DEVICES = {1: "cpu", 2: "cuda", 3: "cuda_host", 4: "opencl", 7: "vulkan", 8: "metal",
                   10: "rocm", 13: "cuda_managed"}


def dlpack_device(x):
    """(device type, device id) from x.__dlpack_device__(), or None where x has none."""
    f = getattr(x, "__dlpack_device__", None)
    if f is None:
        return None
    try:
        kind, index = f()
        return int(kind), int(index)
    except Exception:  # e.g. a meta tensor: it has no DLPack device
        return None


def _where(dev, x):
    if dev is None:
        return device_of(x)
    name = _DLPACK_DEVICES.get(dev[0], f"DLPack device type {dev[0]}")
    return f"{name}:{dev[1]}" if dev[0] == _KDL_CUDA else name


def route_cuda(named):
    """CUDA tensors (DLPack device kDLCUDA = 2) go to ctxpar's cuda device, all or none: a mix
    of CUDA and other tensors is a TypeError naming each one's device. Where the cuda device
    cannot take them (a ctxpar built without CUDA, no CUDA device found), RuntimeError names
    the first CUDA argument and the reason. Returns the CUDA device index of the tensors, or -1
    when they are not on CUDA."""
    devices = {n: dlpack_device(x) for n, x in named.items()}
    cuda = [n for n, d in devices.items() if d is not None and d[0] == _KDL_CUDA]
    if not cuda:
        return -1
    gpus = {devices[n][1] for n in cuda}
    if len(cuda) < len(named) or len(gpus) > 1:
        raise TypeError("tensors on different devices: " +
                        ", ".join(f"{n} on {_where(devices[n], x)}" for n, x in named.items()) +
                        "; put them all on one device (.cpu(), or .to(q.device))")
    from . import _ctxpar
    reason = _ctxpar._cuda_unavailable()
    if reason:
        raise RuntimeError(f"{cuda[0]} is a CUDA tensor; {reason}")
    return gpus.pop()


def sync_cuda(x):
    """Waits for the work torch has queued on x's device (its current stream): the cuda device
    orders its own streams only, so the caller's writes must be done before it reads
    (docs/python.md, "CUDA tensors")."""
    if getattr(x, "is_cuda", False):
        import torch
        torch.cuda.current_stream(x.device).synchronize()


class Tensors:
    """Checked attention operands, ready to cross into C++.

    `named` maps argument names to tensors; every one must be 4-D except those in `rows`
    (LSE, [B, H, T]). fp16 is widened to fp32 (exactly) on the way in; `restore` narrows a
    result back."""

    def __init__(self, named, rows=()):
        names = list(named)
        # CUDA tensors (DLPack kDLCUDA): torch tensors on one GPU, run by the cuda device on
        # their memory in place; outputs are allocated on the same device (new_empty).
        self.cuda_index = route_cuda(named)
        self.like = named[names[0]]
        kinds = {n: framework(x, n) for n, x in named.items()}
        if len(set(kinds.values())) > 1:
            raise TypeError("tensors: mix of NumPy arrays and torch tensors (" +
                            ", ".join(f"{n}: {k}" for n, k in kinds.items()) +
                            "); pass one kind")
        self.kind = kinds[names[0]]
        devices = {n: device_of(x) for n, x in named.items()}
        for n, dev in devices.items():
            if dev != "cpu" and self.cuda_index < 0:
                raise TypeError(f"{n}: on device {dev}; ctxpar runs on the CPU here "
                                "(move it with .cpu())")
        for n, x in named.items():
            want = 3 if n in rows else 4
            if x.ndim != want:
                shape = "[B, H, T]" if n in rows else "[B, T, H, D]"
                raise ValueError(f"{n}: expected a {want}-D tensor {shape}, got shape "
                                 f"{tuple(x.shape)}")
        acts = [n for n in names if n not in rows]
        dtypes = {n: dtype_name(named[n]) for n in acts}
        for n, dt in dtypes.items():
            if dt not in _SUPPORTED:
                raise TypeError(f"{n}: dtype {dt} is not supported; use float32, bfloat16 or "
                                "float16 (ctxpar computes in fp32)")
        if len(set(dtypes.values())) > 1:
            raise TypeError("dtypes differ: " + ", ".join(f"{n} {d}" for n, d in dtypes.items())
                            + "; pass one dtype")
        for n in rows:
            if dtype_name(named[n]) != "float32":
                raise TypeError(f"{n}: expected float32, got {dtype_name(named[n])}")
        self.dtype = dtypes[acts[0]]
        self.converted = self.dtype == "float16"
        self.arrays = {n: self._prepare(x) for n, x in named.items()}

    def _prepare(self, x):
        if self.kind == "torch":
            x = x.detach()  # a view: DLPack refuses tensors that require grad
            return x.float() if self.converted else x
        return x.astype(np.float32) if self.converted else x

    def __getitem__(self, name):
        return self.arrays[name]

    def empty(self, shape, like_dtype=True):
        """A new output in the caller's framework: q's storage dtype (fp32 for fp16 inputs), or
        fp32 when like_dtype is False."""
        if self.kind == "torch":
            import torch
            dt = torch.bfloat16 if like_dtype and self.dtype == "bfloat16" else torch.float32
            if self.cuda_index >= 0:  # on the inputs' GPU
                return self.like.detach().new_empty(tuple(shape), dtype=dt)
            return torch.empty(tuple(shape), dtype=dt)
        return np.empty(tuple(shape), dtype=np.float32)

    def launch(self):
        """The cuda_index argument of the extension (-1: the CPU device), once torch's queued
        work on the tensors is done (sync_cuda). Call it after allocating the outputs."""
        if self.cuda_index >= 0:
            sync_cuda(self.like)
        return self.cuda_index

    def restore(self, x):
        """An activation result in the caller's dtype (fp16 inputs get fp16 results)."""
        if not self.converted:
            return x
        return x.half() if self.kind == "torch" else x.astype(np.float16)


def check_attention_shapes(q, k, v):
    """q [B, T, Hq, D], k and v [B, T, Hkv, D] with Hq % Hkv == 0."""
    B, T, Hq, D = q.shape
    if (k.shape[0], k.shape[1], k.shape[3]) != (B, T, D):
        raise ValueError(f"k: shape {tuple(k.shape)} does not match q's {tuple(q.shape)} "
                         "(expected [B, T, Hkv, D] with q's B, T and D)")
    if tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"v: shape {tuple(v.shape)} must equal k's {tuple(k.shape)}")
    if k.shape[2] < 1 or Hq % k.shape[2] != 0:
        raise ValueError(f"k: kv heads Hkv = {k.shape[2]} must divide q's heads Hq = {Hq} (GQA)")


def check_same_shape(name, x, want, what):
    if tuple(x.shape) != tuple(want):
        raise ValueError(f"{name}: expected shape {tuple(want)} ({what}), got {tuple(x.shape)}")


def int_array(x, name, dtype):
    """Per-token ids / positions as a 1-D NumPy array (small: T entries)."""
    if x is None:
        return None
    if framework_or_none(x) == "torch":
        x = x.detach().cpu().numpy()
    a = np.asarray(x)
    if a.ndim != 1 or not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"{name}: expected a 1-D integer array (one entry per token), got "
                        f"{a.dtype} with shape {a.shape}")
    info = np.iinfo(dtype)
    # Compared as Python ints: NumPy compares uint64 with a Python int through float64, where
    # 2**63 - 1 rounds up to 2**63 and 2**63 itself would pass (and then wrap to -2**63).
    if a.size:
        lo, hi = int(a.min()), int(a.max())
        if lo < info.min or hi > info.max:
            bad, value = next((i, x) for i, x in enumerate(a.tolist())
                              if not info.min <= x <= info.max)
            raise ValueError(f"{name}: token {bad} has {value}, outside "
                             f"{np.dtype(dtype).name}'s range [{info.min}, {info.max}]; "
                             f"pass values that fit {np.dtype(dtype).name}")
    a = np.ascontiguousarray(a, dtype=dtype)
    if name == "positions" and a.size and int(a.min()) == info.min:
        bad = int(np.flatnonzero(a == info.min)[0])
        raise ValueError(f"positions: token {bad} has position {info.min} (INT64_MIN), which "
                         "marks padding (such a token attends to nothing and is seen by none); "
                         "use any other value")
    return a


def check_lse(lse):
    """lse [B, H, T] float32 from a forward: finite, or -inf for a row that sees no key. NaN or
    +inf would make every gradient of the row garbage, so the first one is named."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(lse, torch.Tensor):
        bad = torch.isnan(lse) | torch.isposinf(lse)
        if bool(bad.any()):
            b, h, t = (int(i) for i in bad.nonzero()[0])
            value = float(lse[b, h, t])
        else:
            return
    else:
        bad = np.isnan(lse) | np.isposinf(lse)
        if not bad.any():
            return
        b, h, t = (int(i) for i in np.argwhere(bad)[0])
        value = float(lse[b, h, t])
    raise ValueError(f"lse: batch {b}, head {h}, token {t} holds {value}; lse must be finite "
                     "(or -inf for a row that sees no key): pass the lse the forward returned")


def check_writable_out(name, x):
    """An output written in place must be writable and must not overlap itself (a stride-0
    expanded view, or strides that revisit elements): every element gets its own memory."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        shape, strides = tuple(x.shape), tuple(x.stride())
    else:
        if not x.flags.writeable:
            raise ValueError(f"{name}: the array is read-only")
        shape, strides = x.shape, tuple(s // x.itemsize for s in x.strides)
    dims = sorted((abs(st), n) for n, st in zip(shape, strides) if n > 1)
    reach = 1  # elements spanned by the smaller-stride dims so far
    for st, n in dims:
        if st < reach:
            raise ValueError(f"{name}: its elements overlap in memory (shape {tuple(shape)}, "
                             f"strides {tuple(strides)} in elements; e.g. an expanded or "
                             "broadcast view); pass a tensor with its own memory per element, "
                             "such as torch.empty(shape) / np.empty(shape)")
        reach = st * n


def framework_or_none(x):
    try:
        return framework(x, "x")
    except TypeError:
        return None

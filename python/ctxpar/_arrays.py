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


class Tensors:
    """Checked attention operands, ready to cross into C++.

    `named` maps argument names to tensors; every one must be 4-D except those in `rows`
    (LSE, [B, H, T]). fp16 is widened to fp32 (exactly) on the way in; `restore` narrows a
    result back."""

    def __init__(self, named, rows=()):
        names = list(named)
        kinds = {n: framework(x, n) for n, x in named.items()}
        if len(set(kinds.values())) > 1:
            raise TypeError("tensors: mix of NumPy arrays and torch tensors (" +
                            ", ".join(f"{n}: {k}" for n, k in kinds.items()) +
                            "); pass one kind")
        self.kind = kinds[names[0]]
        devices = {n: device_of(x) for n, x in named.items()}
        for n, dev in devices.items():
            if dev != "cpu":
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
            return torch.empty(tuple(shape), dtype=dt)
        return np.empty(tuple(shape), dtype=np.float32)

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
    if a.size and (a.min() < info.min or a.max() > info.max):
        raise ValueError(f"{name}: values must fit {np.dtype(dtype).name}")
    return np.ascontiguousarray(a, dtype=dtype)


def framework_or_none(x):
    try:
        return framework(x, "x")
    except TypeError:
        return None

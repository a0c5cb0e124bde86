"""What crosses the boundary: zero-copy (the pointer C++ sees is the caller's), and bad inputs
raise ValueError / TypeError naming the argument, never a crash."""
import numpy as np
import pytest
import torch

import ctxpar
from ctxpar import _ctxpar
from conftest import problem


def test_numpy_and_torch_cross_without_copies():
    q = problem()[0]
    assert _ctxpar._data_pointer(q) == q.__array_interface__["data"][0]
    view = q[:, :, 1:3]
    assert _ctxpar._data_pointer(view) == view.__array_interface__["data"][0]
    t = torch.from_numpy(q)
    assert _ctxpar._data_pointer(t) == t.data_ptr()
    b = t.bfloat16()[:, 4:]
    assert _ctxpar._data_pointer(b) == b.data_ptr()


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_out_is_written_in_place(kind):
    q, k, v, _ = problem()
    out = np.full_like(q, np.nan)
    if kind == "torch":
        q, k, v, out = (torch.from_numpy(x) for x in (q, k, v, out))
    pointer = _ctxpar._data_pointer(out)
    got, _ = ctxpar.attention(q, k, v, ranks=2, out=out)
    assert got is out and _ctxpar._data_pointer(out) == pointer
    assert not np.isnan(np.asarray(out)).any()


def bad(**change):
    q, k, v, _ = problem()
    args = dict(q=q, k=k, v=v)
    opts = {}
    for name, value in change.items():
        (args if name in args else opts)[name] = value
    return ctxpar.attention(args["q"], args["k"], args["v"], **opts)


@pytest.mark.parametrize("change, error, words", [
    (dict(q=np.zeros((2, 32, 64), np.float32)), ValueError, "q: expected a 4-D"),
    (dict(k=np.zeros((2, 16, 2, 16), np.float32)), ValueError, "k: shape"),
    (dict(v=np.zeros((2, 32, 1, 16), np.float32)), ValueError, "v: shape"),
    (dict(k=np.zeros((2, 32, 3, 16), np.float32), v=np.zeros((2, 32, 3, 16), np.float32)),
     ValueError, "Hkv = 3"),
    (dict(k=np.zeros((2, 32, 2, 16), np.float64)), TypeError, "k: dtype float64"),
    (dict(q=torch.zeros(2, 32, 4, 16)), TypeError, "mix of NumPy arrays and torch"),
    (dict(q=[[1.0]]), TypeError, "q: expected a NumPy array or a torch tensor"),
    (dict(strategy="rign"), ValueError, "strategy"),
    (dict(layout="zig"), ValueError, "layout"),
    (dict(mask="causl"), ValueError, "mask"),
    (dict(mask=("window", 1)), ValueError, "mask"),
    (dict(mask="documents"), ValueError, "document_ids"),
    (dict(document_ids=np.zeros(5, np.int32)), ValueError, "document_ids: expected one entry"),
    (dict(positions=np.zeros(32, np.float32)), TypeError, "positions"),
    (dict(ranks=0), ValueError, "ranks"),
    (dict(ranks=2000), ValueError, "ranks: must be in [1, 1024]"),
    (dict(q=np.zeros((2, 32, 4, 8), np.float32), k=np.zeros((2, 32, 2, 8), np.float32),
          v=np.zeros((2, 32, 2, 8), np.float32)), ctxpar.Error, "head dim D must be in 16..256"),
])
def test_bad_inputs_name_the_argument(change, error, words):
    with pytest.raises(error) as info:
        bad(**change)
    assert words in str(info.value)


def test_dtype_mix_and_device_mix():
    q, k, v = (torch.from_numpy(x) for x in problem()[:3])
    with pytest.raises(TypeError, match="dtypes differ: q bfloat16, k float32"):
        ctxpar.attention(q.bfloat16(), k, v)
    with pytest.raises(TypeError, match="k: on device meta"):
        ctxpar.attention(q, torch.empty(k.shape, device="meta"), v)


def test_last_dimension_must_be_contiguous():
    q, k, v, _ = problem()
    q_t = np.ascontiguousarray(q.transpose(0, 1, 3, 2)).transpose(0, 1, 3, 2)
    with pytest.raises(ValueError, match="q: the last dimension must be contiguous"):
        ctxpar.attention(q_t, k, v)


def test_read_only_inputs_are_read_and_a_read_only_out_is_refused():
    q, k, v, _ = problem()
    for x in (q, k, v):
        x.flags.writeable = False
    out, _ = ctxpar.attention(q, k, v)
    with pytest.raises(ValueError, match="out: the array is read-only"):
        ctxpar.attention(q, k, v, out=q)


def test_backward_checks_lse_and_dout():
    q, k, v, dout = problem()
    out, lse = ctxpar.attention(q, k, v)
    with pytest.raises(ValueError, match="lse: expected shape"):
        ctxpar.attention_backward(q, k, v, out, lse[:, :, :16], dout)
    with pytest.raises(ValueError, match="dout: expected shape"):
        ctxpar.attention_backward(q, k, v, out, lse, dout[:, :16])


def test_ctxpar_error_is_a_value_error_with_the_library_message():
    assert issubclass(ctxpar.Error, ValueError)

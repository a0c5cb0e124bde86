#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz targets (docs/sanitizers.md) into fuzz/corpus/<target>/:
small valid inputs and near-valid ones (one field wrong), a few dozen files and a few KB per
target. Deterministic; run it again after changing it and commit the result:

    python3 fuzz/make_corpus.py

fuzz/corpus/npy/ (the .npy reader's seeds) predates this script and is left as it is; the
npy_rows seeds are built from it.

regression_* inputs go to fuzz/regressions/<target>/ instead: inputs that crashed a target,
which scripts/fuzzers.sh replays on every run. Apart from the corpus, so that the
normal suite's io_fuzz_npy (scripts/fuzz.sh, fuzz/corpus/npy only) is not affected.
"""
import json
import pathlib
import struct

here = pathlib.Path(__file__).resolve().parent
corpus = here / "corpus"


def write(target, name, data):
    d = (here / "regressions" if name.startswith("regression_") else corpus) / target
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_bytes(data if isinstance(data, bytes) else data.encode())


# ---- safetensors: 8-byte LE header length, JSON header padded with spaces, data section ----
def fnv1a64(data, h=0xCBF29CE484222325):
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def safetensors(tensors, metadata=None, checksum=True, pad=0, header_override=None):
    """tensors: [(name, dtype, shape, bytes)] laid out back to back."""
    header, data, off = {}, b"", 0
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + len(raw)]}
        data += raw
        off += len(raw)
    meta = dict(metadata or {})
    if meta:
        header["__metadata__"] = dict(meta)
    if checksum:
        summed = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        h = fnv1a64(summed.encode() + data)
        header.setdefault("__metadata__", {})["checksum"] = "fnv1a64:%016x" % h
    text = header_override if header_override is not None else json.dumps(header)
    text = text.encode() + b" " * pad
    return struct.pack("<Q", len(text)) + text + data


f32 = lambda *v: struct.pack("<%df" % len(v), *v)
two = [("a", "F32", [2], f32(1.0, 2.0)), ("b", "U8", [3], b"\x01\x02\x03")]
write("safetensors", "valid_two.safetensors", safetensors(two, {"step": "3"}))
write("safetensors", "valid_no_checksum.safetensors", safetensors(two, checksum=False))
write("safetensors", "valid_padded.safetensors", safetensors(two, pad=5))
write("safetensors", "valid_empty.safetensors", safetensors([]))
write("safetensors", "valid_scalar.safetensors", safetensors([("s", "F64", [], struct.pack("<d", 0.5))]))
write("safetensors", "valid_zero_dim.safetensors", safetensors([("z", "F32", [0, 4], b"")]))
write("safetensors", "valid_all_dtypes.safetensors", safetensors(
    [(f"t{i}", d, [1], b"\x00" * n) for i, (d, n) in enumerate(
        [("BOOL", 1), ("I8", 1), ("I16", 2), ("U16", 2), ("F16", 2), ("BF16", 2), ("I32", 4),
         ("U32", 4), ("I64", 8), ("U64", 8), ("F8_E5M2", 1), ("F8_E4M3", 1)])]))
good = safetensors(two, {"step": "3"})
write("safetensors", "bad_truncated.safetensors", good[:-2])
write("safetensors", "bad_short.safetensors", good[:5])
write("safetensors", "bad_flipped_bit.safetensors", good[:-1] + bytes([good[-1] ^ 1]))
write("safetensors", "bad_header_past_end.safetensors", struct.pack("<Q", 1 << 40) + good[8:])
hdr = lambda d: json.dumps(d)
bad_headers = {
    "bad_overlap": hdr({"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
                        "b": {"dtype": "U8", "shape": [2], "data_offsets": [1, 3]}}),
    "bad_hole": hdr({"a": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}}),
    "bad_dtype": hdr({"a": {"dtype": "Q7", "shape": [3], "data_offsets": [0, 3]}}),
    "bad_shape_overflow": hdr({"a": {"dtype": "F64", "shape": [4294967296, 4294967296],
                                     "data_offsets": [0, 3]}}),
    "bad_negative_shape": hdr({"a": {"dtype": "U8", "shape": [-3], "data_offsets": [0, 3]}}),
    "bad_offsets_reversed": hdr({"a": {"dtype": "U8", "shape": [3], "data_offsets": [3, 0]}}),
    "bad_offsets_type": hdr({"a": {"dtype": "U8", "shape": [3], "data_offsets": "0,3"}}),
    "bad_metadata_type": hdr({"__metadata__": {"step": 3}}),
    "bad_metadata_list": hdr({"__metadata__": [1, 2]}),
    "bad_entry_type": hdr({"a": [1, 2, 3]}),
    "bad_not_object": "[1, 2, 3]",
    "bad_json": '{"a": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]',
    "bad_checksum_text": hdr({"__metadata__": {"checksum": "fnv1a64:zz"},
                              "a": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]}}),
    # Nested values inside an entry (a few levels; the fuzzer deepens them).
    "nested_metadata": hdr({"__metadata__": {"x": "1"}, "a": {"dtype": "U8", "shape": [3],
                            "data_offsets": [0, 3], "extra": [[[[[[[[{"k": [1]}]]]]]]]]}}),
}
# 8000 nested lists in an entry (16 KB): a recursive copy or dump of the header overflowed the
# stack.
deep = "[" * 8000 + "]" * 8000
bad_headers["regression_deep_nesting"] = hdr({"__metadata__": {"x": "1"}, "a": {
    "dtype": "U8", "shape": [3], "data_offsets": [0, 3], "extra": 0}}).replace("0}}", deep + "}}")
for name, text in bad_headers.items():
    write("safetensors", name + ".safetensors", safetensors([], checksum=False,
          header_override=text) + b"\x01\x02\x03")

# ---- npy: regression seeds beside the NumPy files -------------------------------------------
def npy(descr, shape, data=b""):
    h = "{'descr': '%s', 'fortran_order': False, 'shape': %s, }" % (descr, shape)
    h += " " * ((64 - (10 + len(h) + 1) % 64) % 64) + "\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(h)) + h.encode() + data

# A zero first, then dimensions whose product overflows int64 (Tensor::numel).
overflow = npy("<f4", "(0, 4294967296, 4294967296, 4294967296)")
write("npy", "regression_numel_overflow.npy", overflow)

# ---- npy_rows: [axis | 0x80 bf16] [n] n x uint16 LE rows, then a .npy file ---------------
def rows_input(axis, rows, npy, bf16=False):
    head = bytes([axis | (0x80 if bf16 else 0), len(rows)])
    return head + b"".join(struct.pack("<H", r) for r in rows) + npy

cases = [("f32_2x3.npy", 1, [0, 2]), ("f32_2x3.npy", 0, [1]), ("f32_2x3.npy", 1, [2, 1]),
         ("f32_2x3.npy", 1, [3]), ("f32_2x3.npy", 2, [0]), ("f32_1x2x2x2.npy", 1, [0, 1]),
         ("f32_1x2x2x2.npy", 2, [1]), ("f32_1x2x2x2.npy", 3, [0, 1]), ("f16_4.npy", 0, [0, 3]),
         ("i32_3x1x2.npy", 0, [0, 2]), ("i64_5.npy", 0, [1, 2, 4]), ("fortran_2x2.npy", 0, [0]),
         ("f32_0x3.npy", 1, [0]), ("f32_0x3.npy", 0, []), ("f64_2.npy", 0, [1]),
         ("f32_v2.npy", 0, [0]), ("f32_v3.npy", 0, [0])]
for i, (src, axis, rows) in enumerate(cases):
    image = (corpus / "npy" / src).read_bytes()
    write("npy_rows", f"{i:02d}_{src[:-4]}_axis{axis}.bin", rows_input(axis, rows, image, bf16=(i % 4 == 3)))
write("npy_rows", "regression_numel_overflow.bin", rows_input(1, [0], overflow))
write("npy_rows", "zero_columns.bin", rows_input(0, [0, 1], npy("<f4", "(2, 0, 3)")))
write("npy_rows", "scalar.bin", rows_input(0, [0], npy("<f4", "()", struct.pack("<f", 1.5))))

# ---- mask: the --mask text, then optionally "\n" and --seq --------------------------------
masks = ["none", "causal", "window:128,0", "window:-1,-1", "causal+window:256,0",
         "documents:300,724\n1024", "causal+documents:512,512\n1024", "documents:1,2,3\n6",
         "documents\n64", "documents:1024+causal\n1024", "causal+window:0,0+documents:8,8\n16",
         "window:12", "window:a,b", "documents:0,4\n4", "documents:,\n4", "documents:3,4\n8",
         "causal++none", "", "Causal", "documents:99999999999999999999\n64",
         "window:99999999999999999999,0"]
for i, m in enumerate(masks):
    write("mask", f"{i:02d}.txt", m)
# Lengths near 2^63: their sum overflowed int64 in the job's validation.
write("mask", "regression_documents_sum_overflow.txt", "documents:9223372036854775807,1\n1024")

# ---- options: the arguments after `ctxpar attention`, one a line ---------------------------
argvs = [
    ["--seq", "4096", "--heads", "8"],
    ["--seq", "64K", "--heads", "2", "--head-dim", "64", "--ranks", "4", "--strategy", "ring",
     "--layout", "zigzag", "--mask", "causal", "--backward", "--check"],
    ["--strategy", "hybrid", "--ulysses-degree", "2", "--ranks", "4", "--kv-heads", "2"],
    ["--seq", "1M", "--ranks", "8", "--layout", "striped", "--dtype", "bf16"],
    ["--link-gbps", "1e-7"], ["--link-gbps", "0", "--link-latency-us", "1e7"],
    ["--threads", "0"], ["--threads", "1025"], ["--timeout", "nan"], ["--timeout", "inf"],
    ["--seed", "9223372036854775808"], ["--seed", "-1"], ["--seq", "9999999999999999999K"],
    ["--seq", "8M", "--heads", "65536"], ["--sq", "5"], ["--seq"], ["--seq", "--heads", "2"],
    ["--seq", "4096", "--seq", "8192"], ["--device", "sim", "--sim-seed", "7"],
    ["--device", "gpu"], ["--transport", "mpi"], ["--layout-in", "bhtd"],
    ["--q", "q.npy"], ["--check-budget", "-1"], ["--repeats", "1000001"],
    ["--mask", "causal+documents:2048,2048", "--seq", "4096"], ["positional"], ["-x"],
]
for i, a in enumerate(argvs):
    write("options", f"{i:02d}.txt", "\n".join(a))

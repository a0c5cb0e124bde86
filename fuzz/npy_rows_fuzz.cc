// libFuzzer target for the per-rank reader of a .npy file (src/io/npy.cc, read_npy_rows: what
// each MPI rank does with --q/--k/--v). Built and run by scripts/fuzzers.sh.
//
// Input: byte 0 picks the token axis (0..3) and the float type (bit 7: bf16), byte 1 the
// number of rows n (0..15), bytes 2..2+2n the row indices (little-endian uint16; kept as
// given, so unsorted and out-of-range lists are tried too); the rest is the .npy file.
//
// Properties checked on every input:
//   - read_npy_rows never crashes, leaks or reads out of bounds; it returns or throws
//     ctxpar::Error naming the file;
//   - it accepts no file that read_npy refuses;
//   - what it returns is bitwise read_npy's tensor cut to those rows on that axis.
#include <cstring>
#include <vector>

#include "ctxpar/error.h"
#include "ctxpar/npy.h"
#include "fuzz_support.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const int dim = data[0] & 3;
  const ctxpar::DType ft = (data[0] & 0x80) ? ctxpar::DType::bf16 : ctxpar::DType::f32;
  const size_t n = data[1] & 15;
  if (size < 2 + 2 * n) return 0;
  std::vector<int64_t> rows(n);
  for (size_t i = 0; i < n; ++i) rows[i] = data[2 + 2 * i] | (data[3 + 2 * i] << 8);
  const uint8_t* file = data + 2 + 2 * n;
  const size_t file_size = size - 2 - 2 * n;
  const std::string path = fuzz::as_file(file, file_size);
  if (path.empty()) return 0;

  bool ok_rows = false, ok_full = false;
  ctxpar::Tensor got, full;
  try {
    got = ctxpar::read_npy_rows(path, dim, rows, ft);
    ok_rows = true;
  } catch (const ctxpar::Error& e) {
    fuzz::check_message("npy_rows_fuzz", e.what(), path);
  }
  try {
    full = ctxpar::read_npy(path, ft);
    ok_full = true;
  } catch (const ctxpar::Error&) {}
  if (ok_rows && !ok_full) fuzz::fail("npy_rows_fuzz", "accepted a file read_npy refuses", path);
  if (!ok_rows) return 0;

  // The reference: full (C order) cut to `rows` on axis `dim`.
  const ctxpar::Shape& s = full.shape();
  if (dim >= static_cast<int>(s.size()))
    fuzz::fail("npy_rows_fuzz", "accepted an axis the file does not have", std::to_string(dim));
  int64_t outer = 1, inner = static_cast<int64_t>(ctxpar::dtype_size(full.dtype()));
  for (int a = 0; a < dim; ++a) outer *= s[a];
  for (size_t a = dim + 1; a < s.size(); ++a) inner *= s[a];
  ctxpar::Shape want_shape = s;
  want_shape[dim] = static_cast<int64_t>(n);
  if (got.shape() != want_shape || got.dtype() != full.dtype())
    fuzz::fail("npy_rows_fuzz", "wrong shape or type", ctxpar::shape_str(got.shape()));
  const auto* src = static_cast<const uint8_t*>(full.data());
  const auto* out = static_cast<const uint8_t*>(got.data());
  for (int64_t o = 0; o < outer; ++o)
    for (size_t i = 0; i < n; ++i) {
      if (rows[i] >= s[dim]) fuzz::fail("npy_rows_fuzz", "accepted a row past the end", path);
      const size_t at_out = (o * static_cast<int64_t>(n) + static_cast<int64_t>(i)) * inner;
      const size_t at_src = (o * s[dim] + rows[i]) * inner;
      if (std::memcmp(out + at_out, src + at_src, static_cast<size_t>(inner)) != 0)
        fuzz::fail("npy_rows_fuzz", "rows differ from read_npy's", std::to_string(i));
    }
  return 0;
}

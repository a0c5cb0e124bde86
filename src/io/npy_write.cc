// .npy writer (format: see npy.cc) and the atomic file writes every output of ctxpar goes
// through: a temporary beside the target (mkstemp, never through a planted link), fsync of
// the file, rename over the target: a reader sees the old file or the whole new one, never a
// part. The folder is not fsynced, so after a power loss the rename itself may be undone (the
// old file back, the temporary left beside it).
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "ctxpar/npy.h"
#include "io/npy_format.h"
#include "io/output_file.h"

namespace ctxpar {

using npy_format::fail;
using npy_format::kMagic;
using npy_format::kMagicLen;

namespace {

std::vector<uint8_t> header_bytes(const char* descr, const Shape& shape) {
  std::string dict = std::string("{'descr': '") + descr + "', 'fortran_order': False, 'shape': (";
  for (size_t i = 0; i < shape.size(); ++i) dict += std::to_string(shape[i]) + ", ";
  if (shape.size() > 1)
    dict.resize(dict.size() - 2);  // (n,) for 1-D, (a, b) otherwise
  else if (shape.size() == 1)
    dict.resize(dict.size() - 1);
  dict += "), }";
  // Pad with spaces so that the data starts on a 64-byte boundary, header ends with '\n'.
  int version = 1;
  size_t prefix = 10;
  size_t total = (prefix + dict.size() + 1 + 63) / 64 * 64;
  if (total - prefix > 0xffff) {
    version = 2;
    prefix = 12;
    total = (prefix + dict.size() + 1 + 63) / 64 * 64;
  }
  dict.append(total - prefix - dict.size() - 1, ' ');
  dict += '\n';
  std::vector<uint8_t> out(kMagic, kMagic + kMagicLen);
  out.push_back(static_cast<uint8_t>(version));
  out.push_back(0);
  const uint64_t len = dict.size();
  for (int i = 0; i < (version == 1 ? 2 : 4); ++i)
    out.push_back(static_cast<uint8_t>(len >> (8 * i)));
  out.insert(out.end(), dict.begin(), dict.end());
  return out;
}

}  // namespace

std::vector<uint8_t> npy_bytes(const TensorView& t) {
  CTXPAR_CHECK(!t.empty() || t.numel() == 0, "npy: empty tensor view");
  CTXPAR_CHECK(t.ndim() >= 1, "npy: tensor must have at least one dimension");
  const char* descr = t.dtype() == DType::i32 ? "<i4" : t.dtype() == DType::i64 ? "<i8" : "<f4";
  std::vector<uint8_t> out = header_bytes(descr, t.shape());
  // f32 stays f32, ints stay ints, bf16 widens to f32 (NumPy has no bfloat16).
  const DType stored = t.dtype() == DType::bf16 ? DType::f32 : t.dtype();
  const size_t at = out.size();
  out.resize(at + static_cast<size_t>(t.numel()) * dtype_size(stored));
  if (t.numel() > 0) {
    TensorView dst(out.data() + at, stored, t.shape());
    copy_into(t, dst);
  }
  return out;
}

void write_npy(const std::string& path, const TensorView& t) {
  write_file_atomic(path, npy_bytes(t));
}

namespace {
template <typename T>
void write_ints(const std::string& path, std::span<const T> values, const Shape& shape,
                DType dtype) {
  Shape s = shape.empty() ? Shape{static_cast<int64_t>(values.size())} : shape;
  TensorView v(const_cast<T*>(values.data()), dtype, s);
  CTXPAR_CHECK(v.numel() == static_cast<int64_t>(values.size()), "write_npy ", path, ": shape ",
               shape_str(s), " does not match ", values.size(), " values");
  write_npy(path, v);
}
}  // namespace

void write_npy(const std::string& path, std::span<const int64_t> values, const Shape& shape) {
  write_ints(path, values, shape, DType::i64);
}

void write_npy(const std::string& path, std::span<const int32_t> values, const Shape& shape) {
  write_ints(path, values, shape, DType::i32);
}

void write_file_atomic(const std::string& path, std::span<const uint8_t> bytes) {
  write_file_atomic(path, std::span<const std::span<const uint8_t>>(&bytes, 1));
}

void write_file_atomic(const std::string& path, std::span<const std::span<const uint8_t>> pieces) {
  std::string tmpl;
  const int fd = open_temp_beside(path, &tmpl);
  if (fd < 0)
    fail(path, std::string("cannot create a temporary file beside it: ") + std::strerror(errno));
  auto give_up = [&](const char* what) {
    const int err = errno;
    close(fd);
    unlink(tmpl.c_str());
    fail(path, std::string(what) + ": " + std::strerror(err));
  };
  for (std::span<const uint8_t> bytes : pieces) {
    size_t off = 0;
    while (off < bytes.size()) {
      ssize_t n = write(fd, bytes.data() + off, bytes.size() - off);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) give_up("write failed");
      off += static_cast<size_t>(n);
    }
  }
  match_umask(fd);  // a result file is as readable as any other the user creates
  if (fsync(fd) != 0) give_up("fsync failed");
  if (close(fd) != 0) {
    unlink(tmpl.c_str());
    fail(path, std::string("close failed: ") + std::strerror(errno));
  }
  if (std::rename(tmpl.c_str(), path.c_str()) != 0) {
    const int err = errno;
    unlink(tmpl.c_str());
    fail(path, std::string("rename failed: ") + std::strerror(err));
  }
}

void write_file_atomic(const std::string& path, const std::string& text) {
  write_file_atomic(
      path, std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(text.data()), text.size()));
}

}  // namespace ctxpar

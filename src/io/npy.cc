// The .npy readers: a whole image in memory, a file (straight into the Tensor), a file's token
// rows, its header alone; each starts from the header parse of npy_header.cc.
#include "ctxpar/npy.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>

#include "io/npy_format.h"

namespace ctxpar {

static_assert(std::endian::native == std::endian::little,
              ".npy data is read as little-endian; a big-endian host needs byte swapping");

namespace {

using npy_format::element_size;
using npy_format::fail;

float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  uint32_t u;
  if (exp == 0) {
    // Zero or subnormal: mant * 2^-24 is exact in fp32.
    float f = std::ldexp(static_cast<float>(mant), -24);
    std::memcpy(&u, &f, 4);
    u |= sign;
  } else if (exp == 31) {
    u = sign | 0x7f800000u | (mant << 13);  // inf, NaN (payload kept)
  } else {
    u = sign | ((exp + 112) << 23) | (mant << 13);  // rebias 15 -> 127
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

DType tensor_dtype(NpyType t, DType float_dtype) {
  switch (t) {
    case NpyType::f16:
    case NpyType::f32:
      return float_dtype;
    case NpyType::i32:
      return DType::i32;
    case NpyType::i64:
      return DType::i64;
  }
  return DType::f32;
}

// Converts `count` stored elements at `src` into `dst` (element offset `at`).
void decode(const uint8_t* src, uint64_t count, NpyType type, Tensor& dst, uint64_t at) {
  const DType to = dst.dtype();
  if ((type == NpyType::f32 && to == DType::f32) || type == NpyType::i32 || type == NpyType::i64) {
    std::memcpy(static_cast<uint8_t*>(dst.data()) + at * element_size(type), src,
                count * element_size(type));
    return;
  }
  for (uint64_t i = 0; i < count; ++i) {
    float x;
    if (type == NpyType::f16) {
      uint16_t h;
      std::memcpy(&h, src + 2 * i, 2);
      x = half_to_float(h);
    } else {
      std::memcpy(&x, src + 4 * i, 4);
    }
    if (to == DType::f32)
      dst.ptr<float>()[at + i] = x;
    else
      dst.ptr<uint16_t>()[at + i] = f32_to_bf16(x);
  }
}

void check_float_dtype(DType float_dtype) {
  CTXPAR_CHECK(float_dtype == DType::f32 || float_dtype == DType::bf16,
               "float_dtype: expected fp32 or bf16, got ", dtype_name(float_dtype));
}

}  // namespace

Tensor parse_npy(std::span<const uint8_t> bytes, DType float_dtype, const std::string& name) {
  check_float_dtype(float_dtype);
  NpyHeader h = parse_npy_header(bytes, bytes.size(), name);
  Tensor t(tensor_dtype(h.type, float_dtype), h.shape);
  decode(bytes.data() + h.data_offset, h.data_bytes / element_size(h.type), h.type, t, 0);
  return t;
}

namespace {

// An open .npy file whose header has been read and checked.
struct OpenNpy {
  int fd = -1;
  NpyHeader header;
  OpenNpy() = default;
  OpenNpy(const OpenNpy&) = delete;
  OpenNpy& operator=(const OpenNpy&) = delete;
  ~OpenNpy() {
    if (fd >= 0) close(fd);
  }
};

// Reads exactly `n` bytes at `offset` (pread: no shared file position, so ranks on threads
// may read the same file at once); counts them in `*counted`.
void read_exact(int fd, void* dst, uint64_t n, uint64_t offset, const std::string& path,
                const char* where, uint64_t* counted) {
  auto* p = static_cast<uint8_t*>(dst);
  while (n > 0) {
    const size_t want = static_cast<size_t>(std::min<uint64_t>(n, uint64_t(1) << 30));
    const ssize_t got = pread(fd, p, want, static_cast<off_t>(offset));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0)
      fail(path, std::string("read error in the ") + where + ": " + std::strerror(errno));
    if (got == 0)
      fail(path, std::string("truncated ") + where + " (the file shrank while being read)");
    p += got, n -= static_cast<uint64_t>(got), offset += static_cast<uint64_t>(got);
    if (counted) *counted += static_cast<uint64_t>(got);
  }
}

// Opens `path` and reads its header. O_NONBLOCK so that a FIFO, a socket or a device opens at
// once instead of waiting for a writer; anything but a regular file is refused before a read.
void open_npy(const std::string& path, OpenNpy& f, uint64_t* counted) {
  f.fd = open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (f.fd < 0) fail(path, std::string("cannot open: ") + std::strerror(errno));
  struct stat st = {};
  if (fstat(f.fd, &st) != 0) fail(path, std::string("cannot stat: ") + std::strerror(errno));
  if (!S_ISREG(st.st_mode))
    fail(path, std::string("not a regular file (") +
                   (S_ISFIFO(st.st_mode)   ? "a FIFO"
                    : S_ISDIR(st.st_mode)  ? "a folder"
                    : S_ISSOCK(st.st_mode) ? "a socket"
                                           : "a device") +
                   "); give the path of a .npy file");
  const int flags = fcntl(f.fd, F_GETFL);
  if (flags >= 0) fcntl(f.fd, F_SETFL, flags & ~O_NONBLOCK);
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  // First the fixed prefix to learn the header length, then the header itself.
  std::vector<uint8_t> head(std::min<uint64_t>(size, 12));
  read_exact(f.fd, head.data(), head.size(), 0, path, "header", counted);
  int version = 0;
  const uint64_t end = npy_format::header_end(head, size, path, &version);
  head.resize(end);
  if (end > 12) read_exact(f.fd, head.data() + 12, end - 12, 12, path, "header", counted);
  f.header = parse_npy_header(head, size, path);
}

// Reads `count` stored elements at byte `offset` into `t` from element `at` on, converting
// through a small buffer when the types differ.
void read_elements(const OpenNpy& f, uint64_t offset, uint64_t count, Tensor& t, uint64_t at,
                   const std::string& path, uint64_t* counted) {
  const NpyType type = f.header.type;
  const size_t es = element_size(type);
  if (t.dtype() != DType::bf16 && type != NpyType::f16) {
    read_exact(f.fd, static_cast<uint8_t*>(t.data()) + at * es, count * es, offset, path, "data",
               counted);
    return;
  }
  constexpr uint64_t kChunk = 1 << 16;
  std::vector<uint8_t> buf(static_cast<size_t>(std::min(kChunk, count) * es));
  for (uint64_t done = 0; done < count; done += kChunk) {
    const uint64_t n = std::min(kChunk, count - done);
    read_exact(f.fd, buf.data(), n * es, offset + done * es, path, "data", counted);
    decode(buf.data(), n, type, t, at + done);
  }
}

}  // namespace

NpyHeader read_npy_header(const std::string& path) {
  OpenNpy f;
  open_npy(path, f, nullptr);
  return f.header;
}

Tensor read_npy(const std::string& path, DType float_dtype) {
  check_float_dtype(float_dtype);
  OpenNpy f;
  open_npy(path, f, nullptr);
  Tensor t(tensor_dtype(f.header.type, float_dtype), f.header.shape);
  read_elements(f, f.header.data_offset, f.header.data_bytes / element_size(f.header.type), t, 0,
                path, nullptr);
  return t;
}

Tensor read_npy_rows(const std::string& path, int token_dim, std::span<const int64_t> tokens,
                     DType float_dtype, uint64_t* bytes_read) {
  check_float_dtype(float_dtype);
  OpenNpy f;
  open_npy(path, f, bytes_read);
  const Shape& shape = f.header.shape;
  CTXPAR_CHECK(token_dim >= 0 && token_dim < static_cast<int>(shape.size()), path,
               ": the token axis ", token_dim, " is not an axis of shape ", shape_str(shape));
  const int64_t T = shape[token_dim];
  for (size_t i = 0; i < tokens.size(); ++i)
    CTXPAR_CHECK(tokens[i] >= 0 && tokens[i] < T && (i == 0 || tokens[i] > tokens[i - 1]), path,
                 ": token rows must be increasing indices below ", T, ", got ", tokens[i]);
  // [outer..., T, inner...] in C order: each (outer index, run of consecutive tokens) is one
  // contiguous range of the file.
  int64_t outer = 1, inner = 1;
  for (int d = 0; d < token_dim; ++d) outer *= shape[d];
  for (size_t d = token_dim + 1; d < shape.size(); ++d) inner *= shape[d];
  Shape out_shape = shape;
  out_shape[token_dim] = static_cast<int64_t>(tokens.size());
  Tensor t(tensor_dtype(f.header.type, float_dtype), out_shape);
  if (t.numel() == 0) return t;  // nothing to read (a loop over `outer` empty rows otherwise)
  const uint64_t es = element_size(f.header.type);
  const auto n = static_cast<int64_t>(tokens.size());
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t i = 0; i < n;) {
      int64_t j = i + 1;
      while (j < n && tokens[j] == tokens[j - 1] + 1) ++j;
      const uint64_t src = static_cast<uint64_t>((o * T + tokens[i]) * inner);
      const uint64_t dst = static_cast<uint64_t>((o * n + i) * inner);
      read_elements(f, f.header.data_offset + src * es, static_cast<uint64_t>((j - i) * inner), t,
                    dst, path, bytes_read);
      i = j;
    }
  return t;
}

std::vector<int64_t> read_npy_ints(const std::string& path) {
  Tensor t = read_npy(path);
  if (t.dtype() != DType::i32 && t.dtype() != DType::i64)
    fail(path,
         "expected an integer array (int32 or int64), got a float array; save "
         "a.astype(np.int64)");
  std::vector<int64_t> out(static_cast<size_t>(t.numel()));
  for (size_t i = 0; i < out.size(); ++i)
    out[i] = t.dtype() == DType::i32 ? t.ptr<int32_t>()[i] : t.ptr<int64_t>()[i];
  return out;
}

}  // namespace ctxpar

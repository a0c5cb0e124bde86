// .npy reader and writer. Format: https://numpy.org/doc/stable/reference/generated/numpy.lib.format.html
//
//   "\x93NUMPY" major minor | header length (uint16 LE for 1.x, uint32 LE for 2.x / 3.x)
//   | header: a Python dict literal {'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }
//     padded with spaces and ended by '\n' | data, C order, little-endian here.
//
// The header is parsed by a small hand-written scanner that accepts exactly what NumPy
// writes (and the variants a Python literal allows: either quote, any spacing, trailing
// commas, keys in any order) and rejects everything else with the byte offset of the problem.
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

using npy_format::kMagic;
using npy_format::kMagicLen;
using npy_format::fail;
// NumPy itself refuses headers over 10,000 bytes unless told otherwise; 1 MiB is generous and
// keeps a lying length field from driving a large read.
constexpr uint64_t kMaxHeaderLen = 1 << 20;
constexpr int64_t kMaxDim = int64_t(1) << 40;

size_t type_size(NpyType t) {
  switch (t) {
    case NpyType::f16: return 2;
    case NpyType::f32: return 4;
    case NpyType::i32: return 4;
    case NpyType::i64: return 8;
  }
  return 0;
}

// ---- header dict scanner -----------------------------------------------------------------
class DictScanner {
 public:
  DictScanner(std::string_view text, const std::string& name, uint64_t base)
      : s_(text), name_(name), base_(base) {}

  void parse(NpyHeader& h) {
    bool have_descr = false, have_fortran = false, have_shape = false, fortran = false;
    std::string descr;
    skip_ws();
    expect('{');
    for (;;) {
      skip_ws();
      if (peek() == '}') break;
      std::string key = string_literal();
      skip_ws();
      expect(':');
      skip_ws();
      if (key == "descr") {
        if (have_descr) bad("key 'descr' given twice");
        if (peek() == '[') fail(name_, "structured dtypes are not supported; save a plain array");
        descr = string_literal();
        have_descr = true;
      } else if (key == "fortran_order") {
        if (have_fortran) bad("key 'fortran_order' given twice");
        fortran = boolean();
        have_fortran = true;
      } else if (key == "shape") {
        if (have_shape) bad("key 'shape' given twice");
        h.shape = shape_tuple();
        have_shape = true;
      } else {
        bad("unexpected key '" + printable(key) + "' (a .npy header has descr, fortran_order, shape)");
      }
      skip_ws();
      if (peek() == ',') {
        ++i_;
        continue;
      }
      if (peek() != '}') bad("expected ',' or '}'");
    }
    ++i_;  // '}'
    skip_ws();
    if (i_ != s_.size()) bad("unexpected text after the header dict");
    if (!have_descr || !have_fortran || !have_shape)
      fail(name_, std::string("bad header: missing key '") +
                      (!have_descr ? "descr" : !have_fortran ? "fortran_order" : "shape") + "'");
    h.type = dtype(descr);
    if (fortran) {
      // A Fortran-order array with at most one dimension above 1 has the same bytes as C order.
      int big = 0;
      for (int64_t d : h.shape) big += d > 1;
      if (big > 1)
        fail(name_, "Fortran-order arrays are not supported; save np.ascontiguousarray(a) instead");
    }
  }

 private:
  [[noreturn]] void bad(const std::string& what) {
    fail(name_, "bad header at byte " + std::to_string(base_ + i_) + ": " + what);
  }
  char peek() const { return i_ < s_.size() ? s_[i_] : '\0'; }
  void skip_ws() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\t' || s_[i_] == '\n' || s_[i_] == '\r'))
      ++i_;
  }
  void expect(char c) {
    if (peek() != c) bad(std::string("expected '") + c + "'");
    ++i_;
  }
  std::string string_literal() {
    char q = peek();
    if (q != '\'' && q != '"') bad("expected a quoted string");
    size_t start = ++i_;
    while (i_ < s_.size() && s_[i_] != q) {
      if (s_[i_] == '\\' || s_[i_] == '\n') bad("unsupported character in a string");
      ++i_;
    }
    if (i_ >= s_.size()) bad("unterminated string");
    std::string out(s_.substr(start, i_ - start));
    ++i_;
    return out;
  }
  bool boolean() {
    if (s_.substr(i_, 4) == "True") return i_ += 4, true;
    if (s_.substr(i_, 5) == "False") return i_ += 5, false;
    bad("expected True or False");
  }
  int64_t integer() {
    if (peek() == '-') bad("negative dimension in shape");
    if (peek() < '0' || peek() > '9') bad("expected a whole number in shape");
    int64_t v = 0;
    while (peek() >= '0' && peek() <= '9') {
      v = v * 10 + (peek() - '0');
      if (v > kMaxDim) bad("dimension larger than 2^40 in shape");
      ++i_;
    }
    if (peek() == 'L') ++i_;  // Python 2 long suffix, still in old files
    return v;
  }
  Shape shape_tuple() {
    expect('(');
    Shape shape;
    skip_ws();
    while (peek() != ')') {
      shape.push_back(integer());
      if (shape.size() > 64) bad("too many dimensions in shape");
      skip_ws();
      if (peek() == ',') {
        ++i_;
        skip_ws();
      } else if (peek() != ')') {
        bad("expected ',' or ')' in shape");
      }
    }
    ++i_;
    return shape;
  }
  NpyType dtype(const std::string& d) {
    if (d == "<f4") return NpyType::f32;
    if (d == "<f2") return NpyType::f16;
    if (d == "<i4") return NpyType::i32;
    if (d == "<i8") return NpyType::i64;
    if (d.size() == 3 && d[0] == '>' && (d[1] == 'f' || d[1] == 'i'))
      fail(name_, "big-endian dtype '" + printable(d) +
                      "' is not supported; save a.astype('<" + d.substr(1) + "') instead");
    fail(name_, "unsupported dtype '" + printable(d) +
                    "': expected float32 '<f4', float16 '<f2', int32 '<i4' or int64 '<i8'");
  }

  std::string_view s_;
  const std::string& name_;
  uint64_t base_;
  size_t i_ = 0;
};

uint64_t read_le(const uint8_t* p, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = v << 8 | p[i];
  return v;
}

// Length of magic + version + length field + header, from the first bytes.
uint64_t header_end(std::span<const uint8_t> head, uint64_t file_size, const std::string& name,
                    int* version) {
  if (head.size() < kMagicLen || std::memcmp(head.data(), kMagic, kMagicLen) != 0)
    fail(name, "not a .npy file (bad magic: expected \\x93NUMPY, got '" +
                   printable(std::string_view(reinterpret_cast<const char*>(head.data()),
                                              std::min<size_t>(head.size(), kMagicLen))) +
                   "')");
  if (head.size() < 8) fail(name, "truncated header (file ends inside the version field)");
  const int major = head[6], minor = head[7];
  if (major < 1 || major > 3 || minor != 0)
    fail(name, "unsupported .npy format version " + std::to_string(major) + "." +
                   std::to_string(minor) + " (1.0, 2.0 and 3.0 are supported)");
  const int len_bytes = major == 1 ? 2 : 4;
  if (head.size() < 8u + len_bytes) fail(name, "truncated header (file ends inside the header length)");
  const uint64_t len = read_le(head.data() + 8, len_bytes);
  if (len > kMaxHeaderLen)
    fail(name, "header length " + std::to_string(len) + " is absurd (more than 1 MiB)");
  const uint64_t end = 8 + len_bytes + len;
  if (end > file_size)
    fail(name, "truncated header: it claims " + std::to_string(len) + " bytes but the file has " +
                   std::to_string(file_size) + " bytes in all");
  *version = major;
  return end;
}

}  // namespace

const char* npy_type_name(NpyType t) {
  switch (t) {
    case NpyType::f16: return "float16";
    case NpyType::f32: return "float32";
    case NpyType::i32: return "int32";
    case NpyType::i64: return "int64";
  }
  return "?";
}

NpyHeader parse_npy_header(std::span<const uint8_t> head, uint64_t file_size,
                           const std::string& name) {
  NpyHeader h;
  const uint64_t end = header_end(head, file_size, name, &h.version);
  if (head.size() < end) fail(name, "truncated header");
  const uint64_t start = h.version == 1 ? 10 : 12;
  std::string_view text(reinterpret_cast<const char*>(head.data()) + start, end - start);
  // Versions 1.x and 2.x promise latin-1 / ASCII; 3.0 allows UTF-8. A valid header is ASCII
  // either way, so any other byte is garbage.
  for (size_t i = 0; i < text.size(); ++i)
    if (static_cast<unsigned char>(text[i]) >= 0x80 || text[i] == '\0')
      fail(name, "bad header at byte " + std::to_string(start + i) + ": non-ASCII byte");
  DictScanner(text, name, start).parse(h);
  if (h.shape.empty())
    fail(name, "0-d arrays (scalars) are not supported; save an array with at least one dimension");
  if (h.shape.size() > static_cast<size_t>(kMaxDims))
    fail(name, "shape " + shape_str(h.shape) + " has " + std::to_string(h.shape.size()) +
                   " dimensions; at most " + std::to_string(kMaxDims) + " are supported");
  // numel * size, checked before each multiplication so it cannot overflow. A zero dimension
  // makes it 0 but leaves the others as strides and loop counts: the product of the non-zero
  // dimensions is bounded the same way ((0, 2^32, 2^32) overflowed later products; (2^40, 0)
  // walked 2^40 empty rows).
  // The bound counts at least 4 bytes an element, the fp32 the data is read into: what is
  // accepted here is accepted again when written back as fp32 (an fp16 (0, 42949, 7296, 2^32)
  // passed and its fp32 rewrite did not; fuzz corpus npy/zero_dim_fp16_rewrite).
  constexpr uint64_t kMaxBytes = uint64_t(1) << 62;
  uint64_t bytes = type_size(h.type);
  uint64_t bound = std::max<uint64_t>(bytes, 4);
  bool zero = false;
  for (int64_t d : h.shape) {
    const auto ud = static_cast<uint64_t>(d);
    if (ud == 0) {
      zero = true;
      continue;
    }
    if (bound > kMaxBytes / ud)
      fail(name, "shape " + shape_str(h.shape) +
                     " is absurd (more than 2^62 bytes, counting its non-zero dimensions)");
    bytes *= ud;
    bound *= ud;
  }
  if (zero) bytes = 0;
  h.data_offset = end;
  h.data_bytes = bytes;
  const uint64_t have = file_size - end;
  if (have < bytes)
    fail(name, "truncated data: shape " + shape_str(h.shape) + " of " + npy_type_name(h.type) +
                   " needs " + std::to_string(bytes) + " bytes, the file has " +
                   std::to_string(have));
  if (have > bytes)
    fail(name, "the header's shape " + shape_str(h.shape) + " of " + npy_type_name(h.type) +
                   " is " + std::to_string(bytes) + " bytes but the file has " +
                   std::to_string(have) + " bytes of data");
  return h;
}

namespace {

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
    case NpyType::f32: return float_dtype;
    case NpyType::i32: return DType::i32;
    case NpyType::i64: return DType::i64;
  }
  return DType::f32;
}

// Converts `count` stored elements at `src` into `dst` (element offset `at`).
void decode(const uint8_t* src, uint64_t count, NpyType type, Tensor& dst, uint64_t at) {
  const DType to = dst.dtype();
  if ((type == NpyType::f32 && to == DType::f32) || type == NpyType::i32 || type == NpyType::i64) {
    std::memcpy(static_cast<uint8_t*>(dst.data()) + at * type_size(type), src,
                count * type_size(type));
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
  decode(bytes.data() + h.data_offset, h.data_bytes / type_size(h.type), h.type, t, 0);
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
    if (got < 0) fail(path, std::string("read error in the ") + where + ": " + std::strerror(errno));
    if (got == 0) fail(path, std::string("truncated ") + where + " (the file shrank while being read)");
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
                   (S_ISFIFO(st.st_mode) ? "a FIFO" : S_ISDIR(st.st_mode) ? "a folder"
                    : S_ISSOCK(st.st_mode) ? "a socket" : "a device") +
                   "); give the path of a .npy file");
  const int flags = fcntl(f.fd, F_GETFL);
  if (flags >= 0) fcntl(f.fd, F_SETFL, flags & ~O_NONBLOCK);
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  // First the fixed prefix to learn the header length, then the header itself.
  std::vector<uint8_t> head(std::min<uint64_t>(size, 12));
  read_exact(f.fd, head.data(), head.size(), 0, path, "header", counted);
  int version = 0;
  const uint64_t end = header_end(head, size, path, &version);
  head.resize(end);
  if (end > 12) read_exact(f.fd, head.data() + 12, end - 12, 12, path, "header", counted);
  f.header = parse_npy_header(head, size, path);
}

// Reads `count` stored elements at byte `offset` into `t` from element `at` on, converting
// through a small buffer when the types differ.
void read_elements(const OpenNpy& f, uint64_t offset, uint64_t count, Tensor& t, uint64_t at,
                   const std::string& path, uint64_t* counted) {
  const NpyType type = f.header.type;
  const size_t es = type_size(type);
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
  read_elements(f, f.header.data_offset, f.header.data_bytes / type_size(f.header.type), t, 0,
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
  const uint64_t es = type_size(f.header.type);
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
    fail(path, "expected an integer array (int32 or int64), got a float array; save "
               "a.astype(np.int64)");
  std::vector<int64_t> out(static_cast<size_t>(t.numel()));
  for (size_t i = 0; i < out.size(); ++i)
    out[i] = t.dtype() == DType::i32 ? t.ptr<int32_t>()[i] : t.ptr<int64_t>()[i];
  return out;
}

}  // namespace ctxpar

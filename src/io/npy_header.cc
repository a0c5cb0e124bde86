// The .npy header: the magic, the version, the header length and the header dict, parsed and
// checked against the file's size (the readers of the data are npy.cc). Format:
// https://numpy.org/doc/stable/reference/generated/numpy.lib.format.html
//
//   "\x93NUMPY" major minor | header length (uint16 LE for 1.x, uint32 LE for 2.x / 3.x)
//   | header: a Python dict literal {'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }
//     padded with spaces and ended by '\n' | data, C order, little-endian here.
//
// The header is parsed by a small hand-written scanner that accepts exactly what NumPy
// writes (and the variants a Python literal allows: either quote, any spacing, trailing
// commas, keys in any order) and rejects everything else with the byte offset of the problem.
#include <algorithm>
#include <cstring>
#include <string>
#include <string_view>

#include "ctxpar/npy.h"
#include "io/npy_format.h"

namespace ctxpar {

namespace npy_format {
namespace {

// NumPy itself refuses headers over 10,000 bytes unless told otherwise; 1 MiB is generous and
// keeps a lying length field from driving a large read.
constexpr uint64_t kMaxHeaderLen = 1 << 20;
constexpr int64_t kMaxDim = int64_t(1) << 40;

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
        bad("unexpected key '" + printable(key) +
            "' (a .npy header has descr, fortran_order, shape)");
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
                      (!have_descr     ? "descr"
                       : !have_fortran ? "fortran_order"
                                       : "shape") +
                      "'");
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
      fail(name_, "big-endian dtype '" + printable(d) + "' is not supported; save a.astype('<" +
                      d.substr(1) + "') instead");
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

}  // namespace

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
  if (head.size() < 8u + len_bytes)
    fail(name, "truncated header (file ends inside the header length)");
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

}  // namespace npy_format

using npy_format::fail;

const char* npy_type_name(NpyType t) {
  switch (t) {
    case NpyType::f16:
      return "float16";
    case NpyType::f32:
      return "float32";
    case NpyType::i32:
      return "int32";
    case NpyType::i64:
      return "int64";
  }
  return "?";
}

NpyHeader parse_npy_header(std::span<const uint8_t> head, uint64_t file_size,
                           const std::string& name) {
  NpyHeader h;
  const uint64_t end = npy_format::header_end(head, file_size, name, &h.version);
  if (head.size() < end) fail(name, "truncated header");
  const uint64_t start = h.version == 1 ? 10 : 12;
  std::string_view text(reinterpret_cast<const char*>(head.data()) + start, end - start);
  // Versions 1.x and 2.x promise latin-1 / ASCII; 3.0 allows UTF-8. A valid header is ASCII
  // either way, so any other byte is garbage.
  for (size_t i = 0; i < text.size(); ++i)
    if (static_cast<unsigned char>(text[i]) >= 0x80 || text[i] == '\0')
      fail(name, "bad header at byte " + std::to_string(start + i) + ": non-ASCII byte");
  npy_format::DictScanner(text, name, start).parse(h);
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
  uint64_t bytes = npy_format::element_size(h.type);
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

}  // namespace ctxpar

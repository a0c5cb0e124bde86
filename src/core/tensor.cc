#include "ctxpar/tensor.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <utility>

namespace ctxpar {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32:
      return 4;
    case DType::bf16:
      return 2;
    case DType::i32:
      return 4;
    case DType::i64:
      return 8;
  }
  return 0;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32:
      return "fp32";
    case DType::bf16:
      return "bf16";
    case DType::i32:
      return "i32";
    case DType::i64:
      return "i64";
  }
  return "?";
}

DType parse_dtype(const std::string& name) {
  if (name == "fp32" || name == "f32" || name == "float32") return DType::f32;
  if (name == "bf16" || name == "bfloat16") return DType::bf16;
  if (name == "i32" || name == "int32") return DType::i32;
  if (name == "i64" || name == "int64") return DType::i64;
  throw Error("unknown dtype '" + name + "': use fp32 or bf16");
}

std::string shape_str(const Shape& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

namespace {
// Refuses a shape whose element count or byte count does not fit in int64 (B*T*H*D = 2^64 made
// numel() 0: a 64-byte tensor that fill_normal wrote T*H*D elements into). With a zero
// dimension the count is 0, but the product of the other dimensions is still a stride (and a
// byte offset), so it is bounded the same way: shape [0, 2^32, 2^32] is refused too.
void check_shape_fits(DType dtype, const Shape& shape) {
  int64_t n = 1;
  bool fits = true;
  for (int64_t s : shape) {
    CTXPAR_CHECK(s >= 0, "negative dimension in shape ", shape_str(shape));
    if (s != 0) fits = fits && !__builtin_mul_overflow(n, s, &n);
  }
  fits = fits && !__builtin_mul_overflow(n, int64_t(dtype_size(dtype)), &n);
  CTXPAR_CHECK(fits, "tensor shape ", shape_str(shape), " (", dtype_name(dtype),
               "): its element or byte count overflows int64 (the product of its non-zero "
               "dimensions must be at most ",
               INT64_MAX / int64_t(dtype_size(dtype)), " elements); use smaller dimensions");
}
}  // namespace

TensorView::TensorView(void* data, DType dtype, const Shape& shape)
    : data_(data), dtype_(dtype), ndim_(static_cast<int>(shape.size())) {
  CTXPAR_CHECK(ndim_ <= kMaxDims, "tensor rank ", ndim_, " exceeds ", kMaxDims);
  check_shape_fits(dtype, shape);
  int64_t stride = 1;
  for (int i = ndim_ - 1; i >= 0; --i) {
    shape_[i] = shape[i];
    strides_[i] = stride;
    stride *= shape[i];
  }
}

TensorView::TensorView(void* data, DType dtype, const Shape& shape, const Shape& strides)
    : data_(data), dtype_(dtype), ndim_(static_cast<int>(shape.size())) {
  CTXPAR_CHECK(ndim_ <= kMaxDims, "tensor rank ", ndim_, " exceeds ", kMaxDims);
  CTXPAR_CHECK(strides.size() == shape.size(), "strides ", shape_str(strides),
               " do not match shape ", shape_str(shape));
  for (int i = 0; i < ndim_; ++i) {
    shape_[i] = shape[i];
    strides_[i] = strides[i];
  }
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int i = 0; i < ndim_; ++i) n *= shape_[i];
  return ndim_ ? n : 0;
}

bool TensorView::contiguous() const {
  int64_t stride = 1;
  for (int i = ndim_ - 1; i >= 0; --i) {
    if (shape_[i] != 1 && strides_[i] != stride) return false;
    stride *= shape_[i];
  }
  return true;
}

bool TensorView::dense() const {
  std::array<int, kMaxDims> order = {0, 1, 2, 3};
  std::sort(order.begin(), order.begin() + ndim_,
            [&](int x, int y) { return strides_[x] < strides_[y]; });
  int64_t next = 1;
  for (int k = 0; k < ndim_; ++k) {
    const int i = order[k];
    if (shape_[i] == 1) continue;
    if (strides_[i] != next) return false;
    next *= shape_[i];
  }
  return true;
}

float TensorView::get(int64_t i0, int64_t i1, int64_t i2, int64_t i3) const {
  int64_t o = offset(i0, i1, i2, i3);
  switch (dtype_) {
    case DType::f32:
      return static_cast<const float*>(data_)[o];
    case DType::bf16:
      return bf16_to_f32(static_cast<const uint16_t*>(data_)[o]);
    case DType::i32:
      return static_cast<float>(static_cast<const int32_t*>(data_)[o]);
    case DType::i64:
      return static_cast<float>(static_cast<const int64_t*>(data_)[o]);
  }
  return 0;
}

void TensorView::set(float v, int64_t i0, int64_t i1, int64_t i2, int64_t i3) const {
  int64_t o = offset(i0, i1, i2, i3);
  switch (dtype_) {
    case DType::f32:
      static_cast<float*>(data_)[o] = v;
      break;
    case DType::bf16:
      static_cast<uint16_t*>(data_)[o] = f32_to_bf16(v);
      break;
    case DType::i32:
      static_cast<int32_t*>(data_)[o] = static_cast<int32_t>(v);
      break;
    case DType::i64:
      static_cast<int64_t*>(data_)[o] = static_cast<int64_t>(v);
      break;
  }
}

TensorView TensorView::slice(int d, int64_t begin, int64_t end) const {
  CTXPAR_CHECK(d >= 0 && d < ndim_, "slice: dim ", d, " out of range for rank ", ndim_);
  CTXPAR_CHECK(0 <= begin && begin <= end && end <= shape_[d], "slice: [", begin, ", ", end,
               ") out of range for dim ", d, " of size ", shape_[d]);
  TensorView v = *this;
  v.data_ = static_cast<std::byte*>(data_) + begin * strides_[d] * int64_t(dtype_size(dtype_));
  v.shape_[d] = end - begin;
  return v;
}

TensorView TensorView::transpose(int d0, int d1) const {
  CTXPAR_CHECK(d0 >= 0 && d0 < ndim_ && d1 >= 0 && d1 < ndim_, "transpose: dims ", d0, " and ", d1,
               " out of range for rank ", ndim_);
  TensorView v = *this;
  std::swap(v.shape_[d0], v.shape_[d1]);
  std::swap(v.strides_[d0], v.strides_[d1]);
  return v;
}

void Tensor::Free::operator()(std::byte* p) const { std::free(p); }

Tensor::Tensor(DType dtype, const Shape& shape) : dtype_(dtype), shape_(shape) {
  CTXPAR_CHECK(shape.size() <= kMaxDims, "tensor rank ", shape.size(), " exceeds ", kMaxDims);
  check_shape_fits(dtype, shape);
  size_t n = bytes();
  size_t alloc = (n + 63) / 64 * 64;
  if (alloc == 0) alloc = 64;
  auto* p = static_cast<std::byte*>(std::aligned_alloc(64, alloc));
  CTXPAR_CHECK(p != nullptr, "out of memory allocating ", alloc, " bytes for tensor ",
               shape_str(shape));
  std::memset(p, 0, alloc);
  buf_ = std::shared_ptr<std::byte>(p, Free{});
}

int64_t Tensor::numel() const {
  int64_t n = 1;
  for (int64_t s : shape_) n *= s;
  return n;
}

void Tensor::fill_zero() {
  if (buf_) std::memset(buf_.get(), 0, bytes());
}

Tensor Tensor::copy_of(const TensorView& v) { return copy_of(v, v.dtype()); }

Tensor Tensor::copy_of(const TensorView& v, DType to) {
  Tensor t(to, v.shape());
  copy_into(v, t.view());
  return t;
}

void copy_into(const TensorView& src, const TensorView& dst) {
  CTXPAR_CHECK(src.shape() == dst.shape(), "copy: shape ", shape_str(src.shape()),
               " does not match ", shape_str(dst.shape()));
  const int n = src.ndim();
  Shape full(kMaxDims, 1);
  for (int i = 0; i < n; ++i) full[kMaxDims - n + i] = src.dim(i);
  auto st = [n](const TensorView& t, int i) {
    return i < kMaxDims - n ? 0 : t.stride(i - (kMaxDims - n));
  };
  const size_t es = dtype_size(src.dtype());
  const bool same = src.dtype() == dst.dtype();
  for (int64_t a = 0; a < full[0]; ++a)
    for (int64_t b = 0; b < full[1]; ++b)
      for (int64_t c = 0; c < full[2]; ++c) {
        int64_t so = a * st(src, 0) + b * st(src, 1) + c * st(src, 2);
        int64_t d_o = a * st(dst, 0) + b * st(dst, 1) + c * st(dst, 2);
        int64_t ss = st(src, 3), ds = st(dst, 3);
        if (same && ss == 1 && ds == 1) {
          std::memcpy(static_cast<std::byte*>(dst.data()) + d_o * es,
                      static_cast<const std::byte*>(src.data()) + so * es, full[3] * es);
          continue;
        }
        for (int64_t d = 0; d < full[3]; ++d) {
          int64_t si = so + d * ss, di = d_o + d * ds;
          if (same) {
            std::memcpy(static_cast<std::byte*>(dst.data()) + di * es,
                        static_cast<const std::byte*>(src.data()) + si * es, es);
          } else {
            float x = src.dtype() == DType::f32 ? src.ptr<float>()[si]
                                                : bf16_to_f32(src.ptr<uint16_t>()[si]);
            CTXPAR_CHECK(dst.dtype() == DType::f32 || dst.dtype() == DType::bf16,
                         "copy: cannot convert ", dtype_name(src.dtype()), " to ",
                         dtype_name(dst.dtype()));
            if (dst.dtype() == DType::f32)
              dst.ptr<float>()[di] = x;
            else
              dst.ptr<uint16_t>()[di] = f32_to_bf16(x);
          }
        }
      }
}

namespace {
// splitmix64: a small, portable generator so that seeded inputs are the same everywhere.
uint64_t splitmix(uint64_t& s) {
  uint64_t z = (s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
}  // namespace

void fill_normal(const TensorView& t, uint64_t seed, float scale) {
  uint64_t s = seed * 0x2545f4914f6cdd1dull + 1;
  const int n = t.ndim();
  Shape full(kMaxDims, 1);
  for (int i = 0; i < n; ++i) full[kMaxDims - n + i] = t.dim(i);
  std::array<int64_t, 4> idx{};
  for (idx[0] = 0; idx[0] < full[0]; ++idx[0])
    for (idx[1] = 0; idx[1] < full[1]; ++idx[1])
      for (idx[2] = 0; idx[2] < full[2]; ++idx[2])
        for (idx[3] = 0; idx[3] < full[3]; ++idx[3]) {
          // Box-Muller from two 53-bit uniforms.
          double u1 = ((splitmix(s) >> 11) + 1.0) * 0x1.0p-53;
          double u2 = (splitmix(s) >> 11) * 0x1.0p-53;
          double z = std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
          int64_t i[4];
          for (int k = 0; k < 4; ++k) i[k] = 0;
          for (int k = 0; k < n; ++k) i[k] = idx[kMaxDims - n + k];
          t.set(static_cast<float>(z * scale), i[0], i[1], i[2], i[3]);
        }
}

}  // namespace ctxpar

// Plain tensors. Activations are [B, T, H, D] row-major (batch, tokens, heads, head dim), the
// flash-attention convention; LSE and other per-row statistics are [B, H, T] fp32.
// A TensorView does not own memory and may be strided (strides in elements); a Tensor owns a
// 64-byte-aligned, contiguous buffer.
#pragma once
#include <array>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "ctxpar/error.h"

namespace ctxpar {

enum class DType : uint8_t { f32, bf16, i32, i64 };

size_t dtype_size(DType t);
const char* dtype_name(DType t);
DType parse_dtype(const std::string& name);  // "fp32" | "f32" | "bf16" | "i32" | "i64"

// bf16 is the upper half of an fp32; rounding is to nearest even, NaN stays NaN.
inline float bf16_to_f32(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float round_to_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

constexpr int kMaxDims = 4;
using Shape = std::vector<int64_t>;
std::string shape_str(const Shape& s);

class TensorView {
 public:
  TensorView() = default;
  // Contiguous view of `shape` at `data`.
  TensorView(void* data, DType dtype, const Shape& shape);
  // Strided view; strides in elements.
  TensorView(void* data, DType dtype, const Shape& shape, const Shape& strides);

  void* data() const { return data_; }
  template <typename T>
  T* ptr() const {
    return static_cast<T*>(data_);
  }
  DType dtype() const { return dtype_; }
  int ndim() const { return ndim_; }
  int64_t dim(int i) const { return shape_[i]; }
  int64_t stride(int i) const { return strides_[i]; }
  Shape shape() const { return Shape(shape_.begin(), shape_.begin() + ndim_); }
  Shape strides() const { return Shape(strides_.begin(), strides_.begin() + ndim_); }
  int64_t numel() const;
  bool contiguous() const;
  // Whether the elements are exactly one run of memory from data() on, the dimensions in any
  // order (contiguous() is the row-major case; transpose(1, 2) of a contiguous view is dense).
  // A dimension of size 1 may have any stride.
  bool dense() const;
  bool empty() const { return data_ == nullptr; }
  // Element offset of index (i0, i1, i2, i3) (unused trailing indices are 0).
  int64_t offset(int64_t i0, int64_t i1 = 0, int64_t i2 = 0, int64_t i3 = 0) const {
    return i0 * strides_[0] + i1 * strides_[1] + i2 * strides_[2] + i3 * strides_[3];
  }
  // Reads / writes one element as fp32 (for f32 and bf16) — slow; for tests and references.
  float get(int64_t i0, int64_t i1 = 0, int64_t i2 = 0, int64_t i3 = 0) const;
  void set(float v, int64_t i0, int64_t i1 = 0, int64_t i2 = 0, int64_t i3 = 0) const;
  // Sub-range [begin, end) along dimension `d`, same strides.
  TensorView slice(int d, int64_t begin, int64_t end) const;
  // The same elements with dimensions d0 and d1 swapped (their sizes and strides), no copy: e.g.
  // the [B, T, H, D] view of [B, H, T, D] storage is transpose(1, 2).
  TensorView transpose(int d0, int d1) const;

 private:
  void* data_ = nullptr;
  DType dtype_ = DType::f32;
  int ndim_ = 0;
  std::array<int64_t, kMaxDims> shape_{};
  std::array<int64_t, kMaxDims> strides_{};
};

class Tensor {
 public:
  Tensor() = default;
  Tensor(DType dtype, const Shape& shape);  // zero-filled
  static Tensor zeros(DType dtype, const Shape& shape) { return Tensor(dtype, shape); }
  // Contiguous copy of any view, converting dtype if asked (f32 <-> bf16).
  static Tensor copy_of(const TensorView& v);
  static Tensor copy_of(const TensorView& v, DType to);

  TensorView view() const { return TensorView(buf_.get(), dtype_, shape_); }
  operator TensorView() const { return view(); }
  void* data() const { return buf_.get(); }
  template <typename T>
  T* ptr() const {
    return static_cast<T*>(static_cast<void*>(buf_.get()));
  }
  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  int64_t dim(int i) const { return shape_[i]; }
  int64_t numel() const;
  size_t bytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }
  bool empty() const { return !buf_; }
  void fill_zero();

 private:
  struct Free {
    void operator()(std::byte* p) const;
  };
  std::shared_ptr<std::byte> buf_;
  DType dtype_ = DType::f32;
  Shape shape_;
};

// Copies src into dst elementwise (same shape, any strides, converting f32 <-> bf16).
void copy_into(const TensorView& src, const TensorView& dst);

// Seeded normal(0, 1) * scale fill, reproducible across platforms (own generator, not <random>).
void fill_normal(const TensorView& t, uint64_t seed, float scale = 1.0f);

}  // namespace ctxpar

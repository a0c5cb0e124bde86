// The host work of the kernel operations that are not attention kernels (HostDevice).
#include <cstring>
#include <limits>

#include "device/host_device.h"

namespace ctxpar::device {

void host_add(const TensorView& x, const TensorView& y) {
  CTXPAR_ASSERT(x.dtype() == DType::f32 && y.dtype() == DType::f32 && x.shape() == y.shape(),
                "add: fp32 views of one shape");
  if (x.contiguous() && y.contiguous()) {
    const float* a = x.ptr<const float>();
    float* b = y.ptr<float>();
    const int64_t n = x.numel();
    for (int64_t i = 0; i < n; ++i) b[i] += a[i];  // fixed order: bitwise stable
    return;
  }
  Shape s = x.shape();
  s.resize(kMaxDims, 1);
  const float* a = x.ptr<const float>();
  float* b = y.ptr<float>();
  for (int64_t i0 = 0; i0 < s[0]; ++i0)
    for (int64_t i1 = 0; i1 < s[1]; ++i1)
      for (int64_t i2 = 0; i2 < s[2]; ++i2)
        for (int64_t i3 = 0; i3 < s[3]; ++i3)
          b[y.offset(i0, i1, i2, i3)] += a[x.offset(i0, i1, i2, i3)];
}

void host_fill_zero(const TensorView& t) {
  if (t.contiguous()) {
    std::memset(t.data(), 0, size_t(t.numel()) * dtype_size(t.dtype()));
    return;
  }
  Tensor zeros(t.dtype(), t.shape());
  copy_into(zeros, t);
}

void host_forward_reset(const ForwardStateView& state) {
  host_fill_zero(state.acc());
  host_fill_zero(state.l());
  float* m = state.m().ptr<float>();
  for (int64_t i = 0; i < state.m().numel(); ++i) m[i] = -std::numeric_limits<float>::infinity();
}

void host_pack_kv(const TensorView& k, const TensorView& v, const Tokens& tokens, bool documents,
                  const TensorView& block_k, const TensorView& block_v, std::byte* block_tokens) {
  copy_into(k, block_k);
  copy_into(v, block_v);
  const size_t t = size_t(k.dim(1));
  std::memcpy(block_tokens, tokens.positions.data(), t * 8);
  if (documents) std::memcpy(block_tokens + t * 8, tokens.documents.data(), t * 4);
}

namespace {

// Rows along the token axis of a contiguous [B, T, H, D] (rows of H*D elements) or [B, H, T]
// (rows of one element): `outer` blocks of `tokens` rows of `row` bytes each.
struct TokenRows {
  int64_t outer, tokens;
  size_t row;
  explicit TokenRows(const TensorView& t) {
    CTXPAR_ASSERT(t.contiguous() && (t.ndim() == 4 || t.ndim() == 3), "token permutation views");
    if (t.ndim() == 4) {
      outer = t.dim(0);
      tokens = t.dim(1);
      row = size_t(t.dim(2) * t.dim(3)) * dtype_size(t.dtype());
    } else {
      outer = t.dim(0) * t.dim(1);
      tokens = t.dim(2);
      row = dtype_size(t.dtype());
    }
  }
};

template <bool kScatter>
void permute_tokens(const TensorView& src, const TensorView& dst, const TensorView& index) {
  const TokenRows s(src), d(dst);
  CTXPAR_ASSERT(s.outer == d.outer && s.row == d.row && index.dtype() == DType::i64);
  const int64_t n = kScatter ? s.tokens : d.tokens;
  CTXPAR_ASSERT(index.numel() == n);
  const int64_t* idx = index.ptr<const int64_t>();
  const auto* from = static_cast<const std::byte*>(src.data());
  auto* to = static_cast<std::byte*>(dst.data());
  for (int64_t o = 0; o < s.outer; ++o)
    for (int64_t i = 0; i < n; ++i) {
      const int64_t si = kScatter ? i : idx[i], di = kScatter ? idx[i] : i;
      std::memcpy(to + (o * d.tokens + di) * d.row, from + (o * s.tokens + si) * s.row, s.row);
    }
}

}  // namespace

void host_scatter_tokens(const TensorView& src, const TensorView& dst, const TensorView& index) {
  permute_tokens<true>(src, dst, index);
}
void host_gather_tokens(const TensorView& src, const TensorView& dst, const TensorView& index) {
  permute_tokens<false>(src, dst, index);
}

}  // namespace ctxpar::device

// The kernel operations of a device as data (ggml's model: an op is a record of its arguments,
// a backend runs it): one argument struct per operation, and Op, the one of them that
// Device::run(Stream, const Op&) takes. Arguments are views, Tokens spans, a Mask and a
// KernelConfig, copied into the op: the caller may drop those objects at once, not the memory
// they point to (device.h's rules). Shapes are kernel.h's.
#pragma once
#include <cstddef>
#include <variant>

#include "ctxpar/kernel.h"
#include "ctxpar/mask.h"
#include "ctxpar/tensor.h"

namespace ctxpar::op {

// state: m = -inf, l = 0, acc = 0 (ForwardState::reset).
struct ForwardReset {
  static constexpr const char* kName = "forward_reset";
  ForwardStateView state;
};
// attention_forward_block of kernel.h on a state in device memory.
struct ForwardBlock {
  static constexpr const char* kName = "forward_block";
  TensorView q;
  Tokens q_tokens;
  TensorView k, v;
  Tokens k_tokens;
  Mask mask;
  ForwardStateView state;
  KernelConfig config;
};
// attention_forward_finalize of kernel.h.
struct ForwardFinalize {
  static constexpr const char* kName = "forward_finalize";
  ForwardStateView state;
  TensorView out, lse;
  KernelConfig config;
};
// attention_forward of kernel.h: the whole forward of q against the one K/V block it sees,
// O and LSE without a state. Only where the device's caps().whole_forward says so.
struct Forward {
  static constexpr const char* kName = "forward";
  TensorView q;
  Tokens q_tokens;
  TensorView k, v;
  Tokens k_tokens;
  Mask mask;
  TensorView out, lse;
  KernelConfig config;
};
// attention_backward_delta of kernel.h.
struct BackwardDelta {
  static constexpr const char* kName = "backward_delta";
  TensorView out, dout, delta;
  KernelConfig config;
};
// attention_backward_block of kernel.h.
struct BackwardBlock {
  static constexpr const char* kName = "backward_block";
  TensorView q;
  Tokens q_tokens;
  TensorView k, v;
  Tokens k_tokens;
  Mask mask;
  TensorView dout, lse, delta, dq, dk, dv;
  KernelConfig config;
};
// (o_a, lse_a) <- the log-sum-exp merge of two partial results of the same queries over
// disjoint key sets, in place, bitwise kernel.h's merge().
struct Merge {
  static constexpr const char* kName = "merge";
  TensorView o_a, lse_a, o_b, lse_b;
};
// y += x, fp32, same shape, element by element in index order (bitwise stable).
struct Add {
  static constexpr const char* kName = "add";
  TensorView x, y;
};
// copy_into (any strides, fp32 <-> bf16).
struct Copy {
  static constexpr const char* kName = "copy";
  TensorView src, dst;
};
struct FillZero {
  static constexpr const char* kName = "fill_zero";
  TensorView t;
};
// A travelling K/V block: [k | v | positions | documents] into the block (KvPacking layout:
// k, v [B, T, H, D] in their dtype, then T int64 positions, then T int32 document ids when
// `documents`).
struct PackKv {
  static constexpr const char* kName = "pack_kv";
  TensorView k, v;
  Tokens tokens;
  bool documents = false;
  TensorView block_k, block_v;
  std::byte* block_tokens = nullptr;
};
// Token permutations along the token axis (dim 1 of [B, T, H, D], dim 2 of [B, H, T]); `index`
// is an int64 view of src's token count:
//   ScatterTokens: dst[.., index[i], ..] = src[.., i, ..]
//   GatherTokens:  dst[.., i, ..] = src[.., index[i], ..]
struct ScatterTokens {
  static constexpr const char* kName = "scatter_tokens";
  TensorView src, dst, index;
};
struct GatherTokens {
  static constexpr const char* kName = "gather_tokens";
  TensorView src, dst, index;
};

}  // namespace ctxpar::op

namespace ctxpar {

// One kernel operation. A device runs it by visiting `args` (each device has one overload per
// argument struct, so a missing one does not compile).
struct Op {
  std::variant<op::ForwardReset, op::ForwardBlock, op::ForwardFinalize, op::Forward,
               op::BackwardDelta, op::BackwardBlock, op::Merge, op::Add, op::Copy, op::FillZero,
               op::PackKv, op::ScatterTokens, op::GatherTokens>
      args;
  // The operation's name, as errors and logs say it ("forward_block").
  const char* name() const {
    return std::visit([](const auto& a) { return a.kName; }, args);
  }
};

}  // namespace ctxpar

// DLPack arrays (nanobind's nb::ndarray: NumPy arrays, torch tensors, ...) seen as
// ctxpar::TensorView, without copies: the view points at the caller's memory with the caller's
// strides. See docs/python.md, "Zero-copy rules".
#pragma once
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <optional>
#include <string>
#include <vector>

#include "ctxpar/error.h"
#include "ctxpar/kernel.h"
#include "ctxpar/tensor.h"

namespace ctxpar::python {

namespace nb = nanobind;

// Written outputs (out, lse, dq, ...) and read-only inputs (q, k, v, ...: a read-only NumPy
// array is accepted). Neither constrains dtype or device: view_of checks them, so a mistake
// gets a message naming the argument instead of nanobind's "incompatible function arguments".
using Array = nb::ndarray<>;
using ReadArray = nb::ndarray<nb::ro>;

// A view of `a` named `name` in errors. Raises TypeError (not on the CPU, unsupported dtype)
// or ValueError (wrong ndim, last dimension not contiguous) naming the argument. With
// `cuda_index` >= 0 the array must be on that CUDA device instead (DLPack kDLCUDA): the view
// then holds a device address, for the cuda device only (docs/python.md, "CUDA tensors").
TensorView view_of(const ReadArray& a, const char* name, int ndim, int cuda_index = -1);
TensorView view_of(const Array& a, const char* name, int ndim, int cuda_index = -1);

// A one-dimensional integer array (int32 or int64, any stride) copied into a vector: per-token
// positions and document ids are small (T entries).
template <typename T>
std::vector<T> int_vector(const std::optional<ReadArray>& a, const char* name, int64_t tokens);

// The bf16_tier argument ("exact" | "fast"); ValueError naming it otherwise (the Python side,
// _checks.bf16_tier, refuses first: this guards a direct call of the extension).
inline Bf16Tier bf16_tier_arg(const std::string& name) {
  if (const std::optional<Bf16Tier> t = parse_bf16_tier(name)) return *t;
  throw nb::value_error(
      detail::concat("bf16_tier: expected exact or fast, got '", name, "'").c_str());
}

}  // namespace ctxpar::python

#include "arrays.h"

#include <string>

namespace ctxpar::python {
namespace {

const char* device_name(int type) {
  switch (type) {
    case nb::device::cpu::value:
      return "cpu";
    case nb::device::cuda::value:
      return "cuda";
    case nb::device::cuda_host::value:
      return "cuda_host";
    case nb::device::rocm::value:
      return "rocm";
    case nb::device::metal::value:
      return "metal";
    default:
      return "an unknown device";
  }
}

std::string dtype_str(nb::dlpack::dtype t) {
  const char* code = "?";
  switch (static_cast<nb::dlpack::dtype_code>(t.code)) {
    case nb::dlpack::dtype_code::Int:
      code = "int";
      break;
    case nb::dlpack::dtype_code::UInt:
      code = "uint";
      break;
    case nb::dlpack::dtype_code::Float:
      code = "float";
      break;
    case nb::dlpack::dtype_code::Bfloat:
      code = "bfloat";
      break;
    case nb::dlpack::dtype_code::Complex:
      code = "complex";
      break;
    case nb::dlpack::dtype_code::Bool:
      code = "bool";
      break;
    default:
      break;
  }
  return std::string(code) + std::to_string(t.bits);
}

template <typename A>
TensorView view_impl(const A& a, const char* name, int ndim, int cuda_index) {
  if (cuda_index >= 0) {
    if (a.device_type() != nb::device::cuda::value || a.device_id() != cuda_index)
      throw nb::type_error(detail::concat(name, ": the array is on ", device_name(a.device_type()),
                                          ":", a.device_id(), ", the others on cuda:", cuda_index,
                                          "; put them all on one device")
                               .c_str());
  } else if (a.device_type() != nb::device::cpu::value) {
    throw nb::type_error(detail::concat(name, ": the array is on ", device_name(a.device_type()),
                                        "; ctxpar runs on the CPU here: move it with .cpu()")
                             .c_str());
  }
  const nb::dlpack::dtype t = a.dtype();
  DType dt;
  if (t == nb::dtype<float>())
    dt = DType::f32;
  else if (t.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat) && t.bits == 16 &&
           t.lanes == 1)
    dt = DType::bf16;
  else if (t == nb::dtype<int32_t>())
    dt = DType::i32;
  else if (t == nb::dtype<int64_t>())
    dt = DType::i64;
  else
    throw nb::type_error(
        detail::concat(name, ": dtype ", dtype_str(t), " is not supported; use float32 or bfloat16")
            .c_str());
  if (static_cast<int>(a.ndim()) != ndim)
    throw nb::value_error(
        detail::concat(name, ": expected ", ndim, " dimensions, got ", a.ndim()).c_str());
  Shape shape(ndim), strides(ndim);
  for (int i = 0; i < ndim; ++i) {
    shape[i] = static_cast<int64_t>(a.shape(i));
    strides[i] = static_cast<int64_t>(a.stride(i));
  }
  if (ndim > 1 && shape[ndim - 1] > 1 && strides[ndim - 1] != 1)
    throw nb::value_error(
        detail::concat(name, ": the last dimension must be contiguous (stride 1), got stride ",
                       strides[ndim - 1],
                       "; pass a view whose last dimension is contiguous "
                       "(e.g. .contiguous())")
            .c_str());
  return TensorView(const_cast<void*>(static_cast<const void*>(a.data())), dt, shape, strides);
}

}  // namespace

TensorView view_of(const ReadArray& a, const char* name, int ndim, int cuda_index) {
  return view_impl(a, name, ndim, cuda_index);
}
TensorView view_of(const Array& a, const char* name, int ndim, int cuda_index) {
  return view_impl(a, name, ndim, cuda_index);
}

template <typename T>
std::vector<T> int_vector(const std::optional<ReadArray>& a, const char* name, int64_t tokens) {
  if (!a) return {};
  const TensorView v = view_of(*a, name, 1);
  if (v.dtype() != DType::i32 && v.dtype() != DType::i64)
    throw nb::type_error(
        detail::concat(name, ": expected an int32 or int64 array, got ", dtype_name(v.dtype()))
            .c_str());
  if (v.dim(0) != tokens)
    throw nb::value_error(
        detail::concat(name, ": expected one entry per token (", tokens, "), got ", v.dim(0))
            .c_str());
  std::vector<T> out(tokens);
  for (int64_t i = 0; i < tokens; ++i) {
    const int64_t x = v.dtype() == DType::i32 ? v.ptr<int32_t>()[i * v.stride(0)]
                                              : v.ptr<int64_t>()[i * v.stride(0)];
    out[i] = static_cast<T>(x);
  }
  return out;
}
template std::vector<int32_t> int_vector(const std::optional<ReadArray>&, const char*, int64_t);
template std::vector<int64_t> int_vector(const std::optional<ReadArray>&, const char*, int64_t);

}  // namespace ctxpar::python

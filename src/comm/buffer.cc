// Buffer (the unit of point-to-point transfer) and the names of the counted kinds.
#include <cstdlib>
#include <cstring>
#include <new>

#include "ctxpar/comm.h"

namespace ctxpar {

namespace {
// 64 bytes: a cache line and the widest SIMD load, so kernels may use aligned loads on a
// received block.
constexpr size_t kAlignment = 64;
}  // namespace

Buffer Buffer::uninitialized(size_t bytes) {
  Buffer b;
  if (bytes == 0) return b;
  // aligned_alloc wants a size that is a multiple of the alignment.
  const size_t rounded = (bytes + kAlignment - 1) / kAlignment * kAlignment;
  void* p = std::aligned_alloc(kAlignment, rounded);
  CTXPAR_CHECK(p != nullptr, "Buffer: could not allocate ", bytes, " bytes");
  b.data_.reset(static_cast<std::byte*>(p), Free{});  // frees p itself if this throws
  b.size_ = bytes;
  return b;
}

Buffer::Buffer(size_t bytes) : Buffer(uninitialized(bytes)) {
  if (bytes) std::memset(data(), 0, bytes);
}

void Buffer::Free::operator()(std::byte* p) const { std::free(p); }

const char* comm_kind_name(CommKind k) {
  switch (k) {
    case CommKind::send:
      return "send";
    case CommKind::recv:
      return "recv";
    case CommKind::allgather:
      return "allgather";
    case CommKind::reduce_scatter:
      return "reduce_scatter";
    case CommKind::alltoall:
      return "alltoall";
    case CommKind::allreduce:
      return "allreduce";
    case CommKind::barrier:
      return "barrier";
    case CommKind::count_:
      break;
  }
  return "?";
}

}  // namespace ctxpar

// The cuda device's small kernels (kernels.h): thin __global__ wrappers over tile_math.cuh's
// element functions, which RecordingCudaApi runs on the host.
#include "cuda/cuda_check.h"
#include "cuda/kernels.h"

namespace ctxpar::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void strided_kernel(int op, Strided4 a, Strided4 b, int64_t n) {
  const int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= n) return;
  if (op == kStridedCopy)
    copy_strided_element(a, b, e);
  else if (op == kStridedAdd)
    add_strided_element(a, b, e);
  else
    zero_strided_element(a, e);
}

__global__ void fill_kernel(float* p, int64_t n, float value) {
  const int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e < n) p[e] = value;
}

// One thread per (b, call row, h).
__global__ void absorb_kernel(DeviceState st, int64_t batch, int64_t tq, int64_t hq, int64_t d,
                              int64_t row0, int64_t rows, const float* o, const float* lse) {
  const int64_t r = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= batch * rows * hq) return;
  const int64_t h = r % hq, i = (r / hq) % rows, b = r / (hq * rows);
  const int64_t row = (b * hq + h) * tq + row0 + i;
  absorb_partial_row(StateRow{st.acc + ((b * tq + row0 + i) * hq + h) * d, st.m + row, st.l + row},
                     o + r * d, lse[(b * hq + h) * rows + i], d);
}

__global__ void permute_rows_kernel(const std::byte* src, std::byte* dst, int64_t n,
                                    int64_t src_tokens, int64_t dst_tokens, int64_t row,
                                    const int64_t* index, bool scatter) {
  const int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= n) return;
  const BytePair at = permute_rows_byte(e, src_tokens, dst_tokens, row, index, scatter);
  dst[at.dst] = src[at.src];
}

int64_t blocks(int64_t n) { return (n + kThreads - 1) / kThreads; }
void check(const char* kernel) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw_cuda_error(err, kernel, __FILE__, __LINE__);
}

}  // namespace

void launch_strided(StridedOp op, const Strided4& a, const Strided4& b, cudaStream_t stream) {
  const int64_t n = a.count();
  if (n == 0) return;
  strided_kernel<<<blocks(n), kThreads, 0, stream>>>(int(op), a, b, n);
  check("strided_kernel");
}

void launch_fill_f32(float* p, int64_t n, float value, cudaStream_t stream) {
  if (n == 0) return;
  fill_kernel<<<blocks(n), kThreads, 0, stream>>>(p, n, value);
  check("fill_kernel");
}

void launch_absorb_partial(const DeviceState& st, int64_t batch, int64_t tq, int64_t hq, int64_t d,
                           int64_t row0, int64_t rows, const float* o, const float* lse,
                           cudaStream_t stream) {
  const int64_t n = batch * rows * hq;
  if (n == 0) return;
  absorb_kernel<<<blocks(n), kThreads, 0, stream>>>(st, batch, tq, hq, d, row0, rows, o, lse);
  check("absorb_kernel");
}

void launch_permute_rows(const std::byte* src, std::byte* dst, int64_t outer, int64_t src_tokens,
                         int64_t dst_tokens, int64_t row, const int64_t* index, bool scatter,
                         cudaStream_t stream) {
  const int64_t n = outer * (scatter ? src_tokens : dst_tokens) * row;
  if (n == 0) return;
  permute_rows_kernel<<<blocks(n), kThreads, 0, stream>>>(src, dst, n, src_tokens, dst_tokens, row,
                                                          index, scatter);
  check("permute_rows_kernel");
}

}  // namespace ctxpar::cuda

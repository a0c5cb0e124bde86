// The fallback kernel on the GPU: thin __global__ wrappers that map threads to rows and call
// tile_math.cuh, whose functions tests/cuda runs on the host. Exactness first: one thread per
// row, fp32 state, no atomics (the backward's dQ and dK/dV passes each own their rows), built
// with --fmad=false so the products round as the CPU's scalar path rounds them (docs/cuda.md).
// Speed is cuDNN's job; this is the path for what cuDNN cannot take.
#include "cuda/cuda_check.h"
#include "cuda/kernels.h"

namespace ctxpar::cuda {

namespace {

constexpr int kThreads = 64;  // = kTile: one block is one tile of rows

__global__ void tile_ranges_kernel(const int64_t* pos, const int32_t* doc, int64_t n,
                                   bool documents, TileRange* out) {
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t * kTile >= n) return;
  const int64_t end = t * kTile + kTile < n ? t * kTile + kTile : n;
  out[t] = tile_range_of(pos, doc, t * kTile, end, documents);
}

// grid (query tiles, B * Hq): thread x of block (qt, bh) is query row qt * 64 + x.
template <class T>
__global__ void forward_kernel(Problem<T> p, DeviceState st) {
  const int64_t i = int64_t(blockIdx.x) * kTile + threadIdx.x;
  const int64_t b = blockIdx.y / p.hq, h = blockIdx.y % p.hq;
  if (i >= p.tq) return;
  float qrow[kMaxHeadDim];
  const int64_t row = (b * p.hq + h) * p.tq + i;
  forward_row(p, b, h, i,
              StateRow{st.acc + ((b * p.tq + i) * p.hq + h) * p.d, st.m + row, st.l + row}, qrow);
}

// One thread per (b, t, h) row of O.
template <class T>
__global__ void finalize_kernel(DeviceState st, int64_t batch, int64_t tq, int64_t hq, int64_t d,
                                T* out, float* lse) {
  const int64_t r = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= batch * tq * hq) return;
  const int64_t h = r % hq, t = (r / hq) % tq, b = r / (hq * tq);
  const int64_t stat = (b * hq + h) * tq + t;
  finalize_row(st.acc + r * d, st.m[stat], st.l[stat], d, out + r * d, lse + stat);
}

template <class T>
__global__ void delta_kernel(const T* out, const T* dout, int64_t batch, int64_t tq, int64_t hq,
                             int64_t d, float* delta) {
  const int64_t r = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= batch * tq * hq) return;
  const int64_t h = r % hq, t = (r / hq) % tq, b = r / (hq * tq);
  delta[(b * hq + h) * tq + t] = delta_row(out + r * d, dout + r * d, d);
}

// The dQ pass (kKeys false: grid (query tiles, B * Hq), a thread per query row, as the
// forward) or the dK/dV pass (kKeys true: grid (key tiles, B * Hkv), a thread per key row).
template <class T, bool kKeys>
__global__ void backward_kernel(Problem<T> p, BackwardRows rows) {
  const int64_t row = int64_t(blockIdx.x) * kTile + threadIdx.x;
  const int64_t heads = kKeys ? p.hkv : p.hq;
  if (row >= (kKeys ? p.tk : p.tq)) return;
  float a[kMaxHeadDim], dorow[kMaxHeadDim];
  if (kKeys)
    backward_dkdv_row(p, rows, blockIdx.y / heads, blockIdx.y % heads, row, a, dorow);
  else
    backward_dq_row(p, rows, blockIdx.y / heads, blockIdx.y % heads, row, a, dorow);
}

__global__ void merge_kernel(float* o_a, float* lse_a, const float* o_b, const float* lse_b,
                             int64_t batch, int64_t t, int64_t h, int64_t d) {
  const int64_t r = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;  // a (b, t, h) row
  if (r >= batch * t * h) return;
  const int64_t hh = r % h, tt = (r / h) % t, b = r / (h * t);
  const int64_t stat = (b * h + hh) * t + tt;
  merge_row(o_a + r * d, lse_a + stat, o_b + r * d, lse_b[stat], d);
}

template <class S, class D>
__global__ void copy_kernel(View4<const S> src, D* dst, int64_t n, int64_t t, int64_t h,
                            int64_t d) {
  const int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e < n) copy_element(src, dst, t, h, d, e);
}

__global__ void permute_kernel(const std::byte* src, std::byte* dst, int64_t n, int64_t tokens,
                               int64_t row, const int64_t* index, bool scatter) {
  const int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= n) return;
  const BytePair at = permute_byte(e, tokens, row, index, scatter);
  dst[at.dst] = src[at.src];
}

// Kernels are launched with <<<>>>, whose errors are read right after (cudaGetLastError).
void check_launch(const char* kernel) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw_cuda_error(err, kernel, __FILE__, __LINE__);
}

// `kernel` over n items, one thread each, `threads` to a block (nothing when n is 0).
template <class... Params, class... Args>
void launch_items(void (*kernel)(Params...), const char* name, int64_t n, int threads,
                  cudaStream_t stream, Args... args) {
  if (n == 0) return;
  kernel<<<(n + threads - 1) / threads, threads, 0, stream>>>(args...);
  check_launch(name);
}

// `kernel` over (tiles of 64 rows) x (batch * heads) blocks of 64 threads, a thread per row.
template <class... Params, class... Args>
void launch_tiles(void (*kernel)(Params...), const char* name, int64_t tiles, int64_t heads,
                  cudaStream_t stream, Args... args) {
  if (tiles == 0 || heads == 0) return;
  // gridDim.y is at most 65535: B * heads beyond it would need a loop over the batch (TODO
  // in docs/cuda.md); refuse it by name rather than launch a wrong grid.
  if (heads > 65535) throw_cuda_error(cudaErrorInvalidConfiguration, name, __FILE__, __LINE__);
  kernel<<<dim3(tiles, heads), kThreads, 0, stream>>>(args...);
  check_launch(name);
}

}  // namespace

void launch_tile_ranges(const int64_t* positions, const int32_t* documents, int64_t n,
                        bool documents_used, TileRange* out, cudaStream_t stream) {
  launch_items(tile_ranges_kernel, "tile_ranges_kernel", (n + kTile - 1) / kTile, kThreads, stream,
               positions, documents, n, documents_used, out);
}

template <class T>
void launch_forward(const Problem<T>& p, const DeviceState& state, cudaStream_t stream) {
  if (p.tk > 0)
    launch_tiles(forward_kernel<T>, "forward_kernel", p.q_tile_count(), p.batch * p.hq, stream, p,
                 state);
}

template <class T>
void launch_finalize(const DeviceState& state, int64_t batch, int64_t tq, int64_t hq, int64_t d,
                     T* out, float* lse, cudaStream_t stream) {
  launch_items(finalize_kernel<T>, "finalize_kernel", batch * tq * hq, kThreads, stream, state,
               batch, tq, hq, d, out, lse);
}

template <class T>
void launch_delta(const T* out, const T* dout, int64_t batch, int64_t tq, int64_t hq, int64_t d,
                  float* delta, cudaStream_t stream) {
  launch_items(delta_kernel<T>, "delta_kernel", batch * tq * hq, kThreads, stream, out, dout, batch,
               tq, hq, d, delta);
}

template <class T>
void launch_backward(const Problem<T>& p, const BackwardRows& rows, cudaStream_t stream) {
  if (p.tq == 0 || p.tk == 0) return;
  launch_tiles(backward_kernel<T, false>, "backward_kernel (dQ)", p.q_tile_count(), p.batch * p.hq,
               stream, p, rows);
  launch_tiles(backward_kernel<T, true>, "backward_kernel (dK, dV)", p.k_tile_count(),
               p.batch * p.hkv, stream, p, rows);
}

void launch_merge(float* o_a, float* lse_a, const float* o_b, const float* lse_b, int64_t batch,
                  int64_t t, int64_t h, int64_t d, cudaStream_t stream) {
  launch_items(merge_kernel, "merge_kernel", batch * t * h, kThreads, stream, o_a, lse_a, o_b,
               lse_b, batch, t, h, d);
}

template <class S, class D>
void launch_copy(const View4<const S>& src, D* dst, int64_t batch, int64_t t, int64_t h, int64_t d,
                 cudaStream_t stream) {
  const int64_t n = batch * t * h * d;
  launch_items(copy_kernel<S, D>, "copy_kernel", n, 256, stream, src, dst, n, t, h, d);
}

void launch_permute(const std::byte* src, std::byte* dst, int64_t outer, int64_t tokens,
                    int64_t row, const int64_t* index, bool scatter, cudaStream_t stream) {
  const int64_t n = outer * tokens * row;
  launch_items(permute_kernel, "permute_kernel", n, 256, stream, src, dst, n, tokens, row, index,
               scatter);
}

// The storage types: fp32 and bf16 (fp32 compute).
#define CTXPAR_INSTANTIATE(T)                                                                   \
  template void launch_forward<T>(const Problem<T>&, const DeviceState&, cudaStream_t);         \
  template void launch_finalize<T>(const DeviceState&, int64_t, int64_t, int64_t, int64_t, T*,  \
                                   float*, cudaStream_t);                                       \
  template void launch_delta<T>(const T*, const T*, int64_t, int64_t, int64_t, int64_t, float*, \
                                cudaStream_t);                                                  \
  template void launch_backward<T>(const Problem<T>&, const BackwardRows&, cudaStream_t);
CTXPAR_INSTANTIATE(float)
CTXPAR_INSTANTIATE(Bf16)
#undef CTXPAR_INSTANTIATE
template void launch_copy<float, float>(const View4<const float>&, float*, int64_t, int64_t,
                                        int64_t, int64_t, cudaStream_t);
template void launch_copy<float, Bf16>(const View4<const float>&, Bf16*, int64_t, int64_t, int64_t,
                                       int64_t, cudaStream_t);
template void launch_copy<Bf16, Bf16>(const View4<const Bf16>&, Bf16*, int64_t, int64_t, int64_t,
                                      int64_t, cudaStream_t);
template void launch_copy<Bf16, float>(const View4<const Bf16>&, float*, int64_t, int64_t, int64_t,
                                       int64_t, cudaStream_t);

}  // namespace ctxpar::cuda

// Launchers of the fallback kernel (kernels.cu) on a CUDA stream. Every pointer is device
// memory; the per-row mathematics is tile_math.cuh's, the same functions tests/cuda runs on the
// host. Asynchronous: a launch error throws ctxpar::Error naming the kernel (cuda_check.h);
// errors of the kernel's execution surface at the next synchronising call.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "cuda/tile_math.cuh"

namespace ctxpar::cuda {

// The tile ranges of n tokens (positions [n], documents [n] or null): out[ceil(n / 64)].
void launch_tile_ranges(const int64_t* positions, const int32_t* documents, int64_t n,
                        bool documents_used, TileRange* out, cudaStream_t stream);

// DeviceState (a ForwardState on the device) is tile_math.cuh's.

// Absorbs p's K/V block into the state (p's tile pointers must hold launch_tile_ranges'
// output). One thread per query row, one block per 64-row query tile and (batch, head).
template <class T>
void launch_forward(const Problem<T>& p, const DeviceState& state, cudaStream_t stream);
// The state into O ([B, Tq, Hq, D] in T, contiguous) and LSE ([B, Hq, Tq] fp32, contiguous).
template <class T>
void launch_finalize(const DeviceState& state, int64_t batch, int64_t tq, int64_t hq, int64_t d,
                     T* out, float* lse, cudaStream_t stream);
// delta [B, Hq, Tq] from O and dO ([B, Tq, Hq, D] in T, contiguous).
template <class T>
void launch_delta(const T* out, const T* dout, int64_t batch, int64_t tq, int64_t hq, int64_t d,
                  float* delta, cudaStream_t stream);
// Adds the block's contribution to dQ (one thread per query row, over the key tiles) and to
// its dK, dV (a second kernel: one thread per key row, over the query tiles). Deterministic.
template <class T>
void launch_backward(const Problem<T>& p, const BackwardRows& rows, cudaStream_t stream);

// kernel.h's merge over [B, T, H, D] fp32 O and [B, H, T] fp32 LSE, contiguous, into (o_a, lse_a).
void launch_merge(float* o_a, float* lse_a, const float* o_b, const float* lse_b, int64_t batch,
                  int64_t t, int64_t h, int64_t d, cudaStream_t stream);
// A strided [B, T, H, D] view into a contiguous buffer, converting the storage type (pack_kv's
// copies of k and v; fp32 -> bf16 casts).
template <class S, class D>
void launch_copy(const View4<const S>& src, D* dst, int64_t batch, int64_t t, int64_t h, int64_t d,
                 cudaStream_t stream);
// Token permutations of contiguous rows (device.h's scatter_tokens / gather_tokens): `outer`
// blocks of `tokens` rows of `row` bytes; index [tokens] int64 on the device.
void launch_permute(const std::byte* src, std::byte* dst, int64_t outer, int64_t tokens,
                    int64_t row, const int64_t* index, bool scatter, cudaStream_t stream);

// The cuda device's small kernels (kernels_device.cu; math in tile_math.cuh): a strided
// copy / cast, y += x, zero fill (b is a for zero), over every element of a; fill with a
// value; a fused call's fp32 partial absorbed into a state; token permutations between
// different token counts.
enum StridedOp : int { kStridedCopy = 0, kStridedAdd = 1, kStridedZero = 2 };
void launch_strided(StridedOp op, const Strided4& a, const Strided4& b, cudaStream_t stream);
void launch_fill_f32(float* p, int64_t n, float value, cudaStream_t stream);
void launch_absorb_partial(const DeviceState& st, int64_t batch, int64_t tq, int64_t hq, int64_t d,
                           int64_t row0, int64_t rows, const float* o, const float* lse,
                           cudaStream_t stream);
void launch_permute_rows(const std::byte* src, std::byte* dst, int64_t outer, int64_t src_tokens,
                         int64_t dst_tokens, int64_t row, const int64_t* index, bool scatter,
                         cudaStream_t stream);

}  // namespace ctxpar::cuda

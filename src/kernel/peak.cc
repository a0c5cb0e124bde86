// Compiled once per SIMD target (hwy/foreach_target.h): the peak is measured with the vector
// width of the target the kernel actually runs.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernel/peak.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <ctime>
#include <memory>
#include <utility>

#include <unistd.h>

#include "kernel/peak.h"
#include "kernel/simd_tile.h"

HWY_BEFORE_NAMESPACE();
namespace ctxpar::kernel::HWY_NAMESPACE {

// 12 independent FMA chains: enough to cover FMA latency x throughput (4 cycles x 2 ports)
// on Zen 3 and on AVX-512 cores, while staying within 16 registers.
constexpr int kChains = 12;  // a0 .. a11 below

HWY_NOINLINE float FmaChains(int64_t iterations, float seed) {
  const DF d;
  // Named variables, not an array: GCC keeps arrays of vectors on the stack.
  VF a0 = hn::Set(d, seed), a1 = hn::Set(d, seed + 1), a2 = hn::Set(d, seed + 2);
  VF a3 = hn::Set(d, seed + 3), a4 = hn::Set(d, seed + 4), a5 = hn::Set(d, seed + 5);
  VF a6 = hn::Set(d, seed + 6), a7 = hn::Set(d, seed + 7), a8 = hn::Set(d, seed + 8);
  VF a9 = hn::Set(d, seed + 9), a10 = hn::Set(d, seed + 10), a11 = hn::Set(d, seed + 11);
  const VF mul = hn::Set(d, 0.999999f), add = hn::Set(d, 1e-7f);
  for (int64_t i = 0; i < iterations; ++i) {
    a0 = hn::MulAdd(a0, mul, add), a1 = hn::MulAdd(a1, mul, add), a2 = hn::MulAdd(a2, mul, add);
    a3 = hn::MulAdd(a3, mul, add), a4 = hn::MulAdd(a4, mul, add), a5 = hn::MulAdd(a5, mul, add);
    a6 = hn::MulAdd(a6, mul, add), a7 = hn::MulAdd(a7, mul, add), a8 = hn::MulAdd(a8, mul, add);
    a9 = hn::MulAdd(a9, mul, add), a10 = hn::MulAdd(a10, mul, add), a11 = hn::MulAdd(a11, mul, add);
    // An empty asm that "may change" the chains: the compiler can neither drop nor merge the
    // loop, and the values stay in registers ("v": any vector register).
    __asm__ volatile(""
                     : "+v"(a0.raw), "+v"(a1.raw), "+v"(a2.raw), "+v"(a3.raw), "+v"(a4.raw),
                       "+v"(a5.raw), "+v"(a6.raw), "+v"(a7.raw), "+v"(a8.raw), "+v"(a9.raw),
                       "+v"(a10.raw), "+v"(a11.raw));
  }
  VF sum =
      hn::Add(hn::Add(hn::Add(a0, a1), hn::Add(a2, a3)), hn::Add(hn::Add(a4, a5), hn::Add(a6, a7)));
  sum = hn::Add(sum, hn::Add(hn::Add(a8, a9), hn::Add(a10, a11)));
  return hn::GetLane(sum);
}

int64_t Lanes() { return lanes(); }

// The sum of n floats, 8 vectors a step in independent chains (the adds' latency is not what
// is measured): the read loop of measure_read_bandwidth.
HWY_NOINLINE float SumRead(const float* HWY_RESTRICT p, int64_t n) {
  const DF d;
  const int64_t l = lanes();
  VF a0 = hn::Zero(d), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  int64_t i = 0;
  for (; i + 8 * l <= n; i += 8 * l) {
    a0 = hn::Add(a0, hn::LoadU(d, p + i)), a1 = hn::Add(a1, hn::LoadU(d, p + i + l));
    a2 = hn::Add(a2, hn::LoadU(d, p + i + 2 * l)), a3 = hn::Add(a3, hn::LoadU(d, p + i + 3 * l));
    a4 = hn::Add(a4, hn::LoadU(d, p + i + 4 * l)), a5 = hn::Add(a5, hn::LoadU(d, p + i + 5 * l));
    a6 = hn::Add(a6, hn::LoadU(d, p + i + 6 * l)), a7 = hn::Add(a7, hn::LoadU(d, p + i + 7 * l));
  }
  float s = hn::GetLane(hn::SumOfLanes(d, hn::Add(hn::Add(hn::Add(a0, a1), hn::Add(a2, a3)),
                                                  hn::Add(hn::Add(a4, a5), hn::Add(a6, a7)))));
  for (; i < n; ++i) s += p[i];
  return s;
}

}  // namespace ctxpar::kernel::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace ctxpar::kernel {

HWY_EXPORT(FmaChains);
HWY_EXPORT(Lanes);
HWY_EXPORT(SumRead);

namespace {
float fma_chains(int64_t iterations, float seed) {
  return HWY_DYNAMIC_DISPATCH(FmaChains)(iterations, seed);
}
}  // namespace

double process_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

Peak measure_fma_peak(int threads, double seconds) {
  const double flops_per_iter = 2.0 * HWY_NAMESPACE::kChains * simd_lanes();
  // Calibrate the iteration count on one thread so each run lasts about `seconds`.
  int64_t iters = 1 << 16;
  for (;;) {
    const auto t0 = std::chrono::steady_clock::now();
    volatile float sink = fma_chains(iters, 1.0f);
    (void)sink;
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (s > seconds / 4) {
      iters = static_cast<int64_t>(iters * seconds / s);
      break;
    }
    iters *= 4;
  }
  Peak best;
  for (int run = 0; run < 3; ++run) {
    const double c0 = process_cpu_seconds();
    const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads)
    {
      volatile float sink = fma_chains(iters, 1.0f + omp_get_thread_num());
      (void)sink;
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double cpu = (process_cpu_seconds() - c0) / threads;
    best.gflops = std::max(best.gflops, flops_per_iter * iters * threads / s / 1e9);
    best.cpu_gflops = std::max(best.cpu_gflops, flops_per_iter * iters * threads / cpu / 1e9);
  }
  return best;
}

size_t read_bandwidth_bytes() {
  const long llc = sysconf(_SC_LEVEL3_CACHE_SIZE), l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
  const double last = double(std::max({llc, l2, 0L}));
  return size_t(std::max(4 * last, 256.0 * (1 << 20)));
}

ReadBandwidth measure_read_bandwidth(int threads, size_t bytes, int repeats) {
  select_simd_target();
  const int64_t n = int64_t(bytes / sizeof(float));
  std::unique_ptr<float[]> data(new float[size_t(n)]);
  // Each thread touches first the part it reads (its pages then lie near it), as it reads.
  auto part = [&](int t) {
    return std::pair<int64_t, int64_t>{n * t / threads, n * (t + 1) / threads};
  };
#pragma omp parallel num_threads(threads)
  {
    const auto [a, e] = part(omp_get_thread_num());
    std::fill(data.get() + a, data.get() + e, 1.0f);
  }
  ReadBandwidth best;
  best.bytes = size_t(n) * sizeof(float);
  for (int r = 0; r < repeats; ++r) {
    const double c0 = process_cpu_seconds();
    const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads)
    {
      const auto [a, e] = part(omp_get_thread_num());
      volatile float sink = HWY_DYNAMIC_DISPATCH(SumRead)(data.get() + a, e - a);
      (void)sink;
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double cpu = (process_cpu_seconds() - c0) / threads;
    best.bytes_per_second = std::max(best.bytes_per_second, double(best.bytes) / s);
    best.cpu_bytes_per_second = std::max(best.cpu_bytes_per_second, double(best.bytes) / cpu);
  }
  return best;
}

const char* simd_target_name() {
  static const std::string name = simd_targets().chosen;
  return name.c_str();
}
int simd_lanes() {
  select_simd_target();
  return static_cast<int>(HWY_DYNAMIC_DISPATCH(Lanes)());
}

}  // namespace ctxpar::kernel
#endif  // HWY_ONCE

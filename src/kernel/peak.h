// The machine's own FMA peak, measured with the vector width the kernel uses, so that the
// kernel benchmark can report a ratio measured in the same run (machines here are shared).
#pragma once
#include <cstddef>

namespace ctxpar::kernel {

// GFLOP/s of a register-only FMA loop (several independent accumulators per thread, all
// `threads` threads busy at once), best of a few runs of about `seconds` each: by wall time,
// and by process CPU time / threads (which time stolen by other processes does not inflate).
struct Peak {
  double gflops = 0, cpu_gflops = 0;
};
Peak measure_fma_peak(int threads, double seconds = 0.2);

// STREAM-style read bandwidth: the sum of a `bytes` fp32 array, each of `threads` threads
// reading its own part (which it first touched), best of `repeats`; by wall time and by
// process CPU time / threads. What decode, which reads its whole cache for every token, is
// measured against (`ctxpar bench decode`).
struct ReadBandwidth {
  double bytes_per_second = 0, cpu_bytes_per_second = 0;
  size_t bytes = 0;
};
ReadBandwidth measure_read_bandwidth(int threads, size_t bytes, int repeats = 3);
// The array read_bandwidth reads by default: 4x the last-level cache, at least 256 MiB.
size_t read_bandwidth_bytes();

// Process CPU seconds (all threads), for the CPU-time figures.
double process_cpu_seconds();

// The SIMD target the kernel runs (simd_targets().chosen, e.g. "avx512" or "avx2") and its
// float lanes.
const char* simd_target_name();
int simd_lanes();

}  // namespace ctxpar::kernel

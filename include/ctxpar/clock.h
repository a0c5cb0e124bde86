// The library's two clocks: wall time on the steady clock, and the CPU time of the calling
// thread. Every layer times itself with these (device counters, call stats, the kernel's
// probes, the commands' per-rank figures), so two figures of one report are on one clock.
#pragma once
#include <time.h>

#include <chrono>

namespace ctxpar {

// Seconds on the steady clock: monotonic, only differences mean anything.
inline double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// CPU seconds the calling thread has run (CLOCK_THREAD_CPUTIME_ID), its OpenMP workers not
// included. On a shared machine a thread that waited for a core is not charged for the wait,
// as the wall clock charges it: what the thread would take with a core of its own.
inline double thread_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

}  // namespace ctxpar

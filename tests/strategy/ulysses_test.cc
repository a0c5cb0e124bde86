// Ulysses' pipeline over head groups (docs/ulysses.md): the same bits as one group (G = 1,
// ulysses_groups = 1) for Ulysses and hybrid, GQA and replicated KV heads, cpu and sim;
// the asynchronous all-to-all of the cpu device; and the overlap it buys, on the threads
// transport's simulated link.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

#include "ctxpar/device.h"
#include "strategy/internal.h"
#include "strategy/strategy_support.h"
#include "same_bits.h"

namespace ctxpar::testing {
namespace {

using namespace std::chrono_literals;

class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old, had_ = true;
    if (value)
      setenv(name, value, 1);
    else
      unsetenv(name);
  }
  ~ScopedEnv() {
    if (had_)
      setenv(name_, old_.c_str(), 1);
    else
      unsetenv(name_);
  }

 private:
  const char* name_;
  std::string old_;
  bool had_ = false;
};

struct GroupCase {
  StrategyKind kind;
  int p, u;
  int64_t hq, hkv, tokens;
  int threads;
  const char* what;  // the groups it gets
};

// Every case pipelines (G > 1) at least in one direction, except the last, which checks
// that the one-replicated-KV-head case (hk = 1) stays whole. Hybrid with
// ulysses_groups = 4: the ring inside runs once per group.
TEST(Ulysses, HeadGroupsGiveTheUnpipelinedBits) {
  const GroupCase cases[] = {
      {StrategyKind::ulysses, 2, 0, 8, 8, 48, 1, "MHA: hq 4, hk 4, G 4"},
      {StrategyKind::ulysses, 2, 0, 8, 4, 48, 1, "GQA split: hq 4, hk 2, G 2"},
      {StrategyKind::ulysses, 3, 0, 6, 2, 48, 1, "replicated slots: hq 2, hk 2, G 2"},
      {StrategyKind::ulysses, 2, 0, 8, 8, 256, 2,
       "2 kernel threads: forward G 4, backward G 2 (b*hk/G >= threads)"},
      {StrategyKind::hybrid, 4, 2, 8, 8, 48, 1, "ring inside: hq 4, hk 4, G 4"},
      {StrategyKind::hybrid, 3, 1, 8, 2, 48, 1, "ring of 3 inside u = 1: G 2"},
      {StrategyKind::ulysses, 4, 0, 8, 2, 48, 1, "one replicated KV head: G 1"},
  };
  for (const GroupCase& c : cases)
    for (DeviceKind device : {DeviceKind::cpu, DeviceKind::sim})
      for (const char* mask : {"causal", "causal+documents"}) {
        Problem pr;
        pr.hq = c.hq;
        pr.hkv = c.hkv;
        pr.tokens = c.tokens;
        pr.mask = parse_mask(mask);
        pr.build();
        StrategyOptions opt;
        opt.kind = c.kind;
        opt.ulysses_degree = c.u;
        opt.mask = pr.mask;
        opt.kernel.threads = c.threads;
        opt.device.kind = device;
        opt.device.sim_max_delay_us = 20;
        RunResult one, piped;
        opt.ulysses_groups = 1;
        one = run_sharded(pr, c.p, LayoutKind::zigzag, opt);
        // Ulysses pipelines by default; hybrid when asked (its ring's token ids go G times).
        opt.ulysses_groups = c.kind == StrategyKind::hybrid ? 4 : 0;
        piped = run_sharded(pr, c.p, LayoutKind::zigzag, opt);
        const std::string where = std::string(c.what) + ", " + device_name(device) + ", " + mask;
        EXPECT_TRUE(test::same_bits(one.o, piped.o)) << where;
        EXPECT_TRUE(test::same_bits(one.lse, piped.lse)) << where;
        EXPECT_TRUE(test::same_bits(one.dq, piped.dq)) << where;
        EXPECT_TRUE(test::same_bits(one.dk, piped.dk)) << where;
        EXPECT_TRUE(test::same_bits(one.dv, piped.dv)) << where;
        for (int r = 0; r < c.p; ++r) {
          // Same bytes (Ulysses; hybrid's ring sends its token ids once per group),
          // and no more memory than G = 1 (groups' buffers are 1/G; 45-80 % of it here).
          if (c.kind == StrategyKind::ulysses) {
            EXPECT_EQ(one.forward_stats[r].bytes_sent, piped.forward_stats[r].bytes_sent) << where;
            EXPECT_EQ(one.backward_stats[r].bytes_sent, piped.backward_stats[r].bytes_sent)
                << where;
          }
          EXPECT_LE(piped.forward_stats[r].peak_bytes, one.forward_stats[r].peak_bytes) << where;
          EXPECT_LE(piped.backward_stats[r].peak_bytes, one.backward_stats[r].peak_bytes) << where;
        }
      }
}

TEST(Ulysses, BadGroupsOptionIsAnErrorNamingIt) {
  Problem pr;
  pr.build();
  StrategyOptions opt;
  opt.kind = StrategyKind::ulysses;
  for (int bad : {-1, 1025, 5000}) {
    opt.ulysses_groups = bad;
    try {
      run_sharded(pr, 2, LayoutKind::contiguous, opt, false);
      ADD_FAILURE() << "ulysses_groups = " << bad << " was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("ulysses_groups: expected 0 (the default) or 1..1024"),
                std::string::npos)
          << e.what();
    }
  }
}

// The library reads no environment: CTXPAR_ULYSSES_GROUPS is the ctxpar command's to read
// (tools/ctxpar, ulysses_groups_from_env); a bad value reaches no library call.
TEST(Ulysses, LibraryIgnoresTheGroupsVariable) {
  Problem pr;
  pr.build();
  StrategyOptions opt;
  opt.kind = StrategyKind::ulysses;
  const RunResult plain = run_sharded(pr, 2, LayoutKind::zigzag, opt);
  ScopedEnv env("CTXPAR_ULYSSES_GROUPS", "x");
  const RunResult with_env = run_sharded(pr, 2, LayoutKind::zigzag, opt);
  EXPECT_TRUE(test::same_bits(plain.o, with_env.o));
  EXPECT_TRUE(test::same_bits(plain.dq, with_env.dq));
}

// The cpu device's all-to-all is posted, not run: rank 0's call returns before rank 1 has
// called its own (a blocking all-to-all would wait for rank 1, which waits 5 s for rank 0's
// return first). Two all-to-alls of different sizes are pending at once, posted in opposite
// orders by the two ranks: their tags keep them apart, and each lands in place. A third one's
// receive buffer is freed before any wait.
TEST(Ulysses, CpuAlltoallIsPostedAndPendingOnesKeepApart) {
  for (DeviceKind kind : {DeviceKind::cpu, DeviceKind::sim}) {
    std::atomic<bool> returned{false}, seen{true};
    run_threads(2, [&](Communicator& comm) {
      const int r = comm.rank();
      DeviceOptions o;
      o.kind = kind;
      auto dev = make_device(o, r);
      auto filled = [&](size_t chunk, int salt) {
        std::vector<std::byte> host(2 * chunk);
        for (size_t i = 0; i < host.size(); ++i) host[i] = std::byte((i * 13 + r * 7 + salt) & 255);
        return dev->upload(host.data(), host.size());
      };
      const size_t small = 1000, big = 3000;
      DeviceBuffer a = filled(small, 1), b = filled(big, 2);
      DeviceBuffer ra = dev->alloc(2 * small), rb = dev->alloc(2 * big);
      if (r == 1) {
        auto until = std::chrono::steady_clock::now() + 5s;
        while (!returned && std::chrono::steady_clock::now() < until)
          std::this_thread::sleep_for(1ms);
        seen = returned.load();
        dev->alltoall(kCommStream, comm, b, rb, big, 11);
        dev->alltoall(kCommStream, comm, a, ra, small, 10);
      } else {
        dev->alltoall(kCommStream, comm, a, ra, small, 10);
        dev->alltoall(kCommStream, comm, b, rb, big, 11);
        returned = true;
      }
      {  // A receive buffer freed before its wait: its chunks land first (or are dropped).
        DeviceBuffer gone = dev->alloc(2 * small);
        dev->alltoall(kCommStream, comm, a, gone, small, 12);
      }
      dev->wait(kComputeStream, dev->record(kCommStream));
      dev->synchronize();
      for (auto [recv, chunk, salt] : {std::tuple{&ra, small, 1}, {&rb, big, 2}})
        for (int i = 0; i < 2; ++i)  // chunk i came from rank i: its chunk r
          for (size_t x = 0; x < chunk; ++x) {
            const size_t at = r * chunk + x;
            const auto want = std::byte((at * 13 + i * 7 + salt) & 255);
            if (recv->data()[i * chunk + x] != want) {
              ADD_FAILURE() << device_name(kind) << " rank " << r << ": chunk from rank " << i
                            << " byte " << x << " of the " << chunk << "-byte all-to-all";
              return;
            }
          }
    });
    EXPECT_TRUE(seen) << device_name(kind)
                      << ": rank 0's all-to-all did not return before "
                         "rank 1 called its own (it blocked)";
  }
}

// Overlap on the threads transport's simulated link (a message arrives bytes/bandwidth after
// it is sent, whatever the machine's load) around a sleeping inner "kernel": the time rank's
// device waited for transfers. One group waits for the whole transfer (a lower bound, by the
// link model); four groups wait only for the first group in and the last group back.
double ulysses_wait_seconds(int groups, double& link_seconds) {
  constexpr int kRanks = 2;
  constexpr int64_t tl = 2048, hq = 8, hkv = 8, d = 64;
  constexpr double gbps = 0.02, compute_seconds = 0.8;  // the inner's sleep, all groups
  // One chunk each way in and back (P = 2): q, k, v of hq/2 heads; out and lse of hq/2.
  const double in = double(tl * (hq / 2 + hkv) * d * 4), back = double(tl * (hq / 2) * (d + 1) * 4);
  link_seconds = (in + back) / (gbps * 1e9);
  ThreadsOptions topt;
  topt.link.gbytes_per_second = gbps;
  std::vector<double> wait(kRanks);
  run_threads(
      kRanks,
      [&](Communicator& comm) {
        auto dev = make_device(DeviceOptions{}, comm.rank());
        strategy::Call call{{}, dev.get(), Mask{}, KernelConfig{}};
        strategy::Dims& dims = call.dims;
        dims.batch = 1, dims.tokens = tl, dims.hq = hq, dims.hkv = hkv, dims.d = d;
        Tensor q(DType::f32, {1, tl, hq, d}), k(DType::f32, {1, tl, hkv, d}),
            v(DType::f32, {1, tl, hkv, d}), out(DType::f32, {1, tl, hq, d}),
            lse(DType::f32, {1, hq, tl});
        std::vector<int64_t> positions(tl);
        for (int64_t i = 0; i < tl; ++i) positions[i] = comm.rank() * tl + i;
        comm.barrier();  // the ranks start together: start skew is not the all-to-all's wait
        const double w0 = dev->counters().wait_seconds;
        strategy::ulysses_forward(
            comm, call, {q, k, v, Tokens{positions, {}}, out, lse},
            [&](const ForwardArgs& f) {
              std::this_thread::sleep_for(std::chrono::duration<double>(
                  compute_seconds * double(f.q.dim(2)) / double(hq / kRanks)));
            },
            groups);
        dev->synchronize();
        wait[comm.rank()] = dev->counters().wait_seconds - w0;
      },
      topt);
  return std::max(wait[0], wait[1]);
}

TEST(Ulysses, GroupsHideTheAllToAllsBehindCompute) {
  double link = 0;
  const double one = ulysses_wait_seconds(1, link);
  // The lower of two runs: a stall (0.3-1 s under ASan on a loaded machine) only adds to the
  // wait, and the bound (0.5 of the link) is 0.1 s above the expected 0.25.
  const double four = std::min(ulysses_wait_seconds(4, link), ulysses_wait_seconds(4, link));
  std::printf("link %.3f s; waited: G = 1 %.3f s, G = 4 %.3f s\n", link, one, four);
  // G = 1: the whole transfer is waited for (the link cannot deliver it sooner).
  EXPECT_GE(one, 0.9 * link) << "link " << link << " s";
  // G = 4: about a quarter in and a quarter back (0.25 of it), each later group's all-to-all
  // hidden behind a group's compute (0.2 s, longer than its 0.08 s on the link).
  EXPECT_LE(four, 0.5 * link) << "G = 1 waited " << one << " s, link " << link << " s";
}

}  // namespace
}  // namespace ctxpar::testing

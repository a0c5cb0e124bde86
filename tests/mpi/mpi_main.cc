// Run under `mpirun -n P` (the MPI transport) or `torchrun --no-python --nproc-per-node P`
// (the gloo transport). Every strategy, forward and backward, gives bitwise the same outputs
// as the threads transport with the same P and options: rank 0 computes the threads result
// inside this same program and compares every byte.
//
//   mpirun -n 4 test_mpi           # prints one line per case; exit 1 on any difference
//   mpirun -n 2 test_mpi --fault   # rank 1 throws mid-ring: the job must end, naming rank 1
//   torchrun --no-python --nproc-per-node 4 test_mpi [--fault]   # the same over gloo
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "attention_job.h"
#include "ctxpar/comm.h"
#include "ctxpar/gloo.h"
#include "ctxpar/strategy.h"

namespace {

using ctxpar::Tensor;
using ctxpar::cli::AttentionJob;

bool all_zero(const Tensor& t) {
  const auto* p = static_cast<const unsigned char*>(t.data());
  for (size_t i = 0; i < t.bytes(); ++i)
    if (p[i]) return false;
  return true;
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  if (a.empty() || b.empty()) return a.empty() == b.empty();
  return a.shape() == b.shape() && a.dtype() == b.dtype() &&
         std::memcmp(a.data(), b.data(), a.bytes()) == 0;
}

struct Case {
  std::string name;
  AttentionJob job;
};

std::vector<Case> cases(int P) {
  using ctxpar::LayoutKind;
  using ctxpar::StrategyKind;
  AttentionJob base;
  base.seq = 32 * P;
  base.heads = 4;
  base.head_dim = 32;
  base.ranks = P;
  base.backward = true;
  base.keep_outputs = true;
  base.mask = ctxpar::Mask::causal_mask();
  base.timeout_seconds = 60;
  std::vector<Case> out;
  auto add = [&](std::string name, StrategyKind s, LayoutKind l, auto tweak) {
    Case c{std::move(name), base};
    c.job.strategy = s;
    c.job.layout = l;
    tweak(c.job);
    out.push_back(std::move(c));
  };
  auto none = [](AttentionJob&) {};
  add("ring contiguous", StrategyKind::ring, LayoutKind::contiguous, none);
  add("ring zigzag", StrategyKind::ring, LayoutKind::zigzag, none);
  add("ring striped", StrategyKind::ring, LayoutKind::striped, none);
  add("allgather zigzag", StrategyKind::allgather, LayoutKind::zigzag, none);
  add("ulysses contiguous", StrategyKind::ulysses, LayoutKind::contiguous, none);
  add("hybrid zigzag", StrategyKind::hybrid, LayoutKind::zigzag,
      [P](AttentionJob& j) { j.ulysses_degree = P >= 4 ? 2 : 1; });
  add("ring zigzag GQA bf16 window", StrategyKind::ring, LayoutKind::zigzag, [](AttentionJob& j) {
    j.kv_heads = 1, j.dtype = ctxpar::DType::bf16;
    j.mask = ctxpar::parse_mask("window:17,5");
  });
  add("allgather documents no causal", StrategyKind::allgather, LayoutKind::striped,
      [P](AttentionJob& j) {
        j.mask = ctxpar::parse_mask("documents");
        j.document_lengths = {10, 32 * P - 10};
      });
  return out;
}

// The transport this program was launched for: mpi (mpirun) or gloo (torchrun).
ctxpar::TransportKind transport() { return ctxpar::launcher_transport(); }

ctxpar::Communicator& world() {
  return transport() == ctxpar::TransportKind::mpi ? ctxpar::mpi_world()
                                                   : ctxpar::cli::gloo_world(60);
}

int compare_with_threads() {
  const int P = world().size();
  int failures = 0;
  for (Case& c : cases(P)) {
    c.job.transport = transport();
    const auto t0 = std::chrono::steady_clock::now();
    ctxpar::cli::AttentionResult mpi = ctxpar::cli::run_attention_job(c.job);
    if (!mpi.is_root) continue;  // rank 0 compares while the others go on to the next case
    AttentionJob threads_job = c.job;
    threads_job.transport = ctxpar::TransportKind::threads;
    ctxpar::cli::AttentionResult thr = ctxpar::cli::run_attention_job(threads_job);
    std::string bad;
    const std::pair<const char*, std::pair<const Tensor*, const Tensor*>> fields[] = {
        {"out", {&mpi.out, &thr.out}},
        {"lse", {&mpi.lse, &thr.lse}},
        {"dq", {&mpi.dq, &thr.dq}},
        {"dk", {&mpi.dk, &thr.dk}},
        {"dv", {&mpi.dv, &thr.dv}}};
    for (const auto& [name, pair] : fields) {
      if (pair.first->empty())
        bad += std::string(" ") + name + " missing";
      else if (all_zero(*pair.first))
        bad += std::string(" ") + name + " all zero";
      else if (!same_bytes(*pair.first, *pair.second))
        bad += std::string(" ") + name;
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("%s P=%d %-32s %s%s (%.2f s)\n", bad.empty() ? "PASS" : "FAIL", P, c.name.c_str(),
                bad.empty() ? "bitwise equal to threads" : "differs:", bad.c_str(), s);
    failures += !bad.empty();
  }
  std::fflush(stdout);
  return failures ? 1 : 0;
}

// Rank 1 throws between two ring forwards while rank 0 waits inside the second one for
// rank 1's K/V block: run_mpi must end the whole job with a message naming rank 1.
int fault() {
  auto body = [](ctxpar::Communicator& comm) {
    comm.set_timeout(std::chrono::seconds(100));  // longer than ctest's limit: abort, not timeout
    ctxpar::StrategyOptions options;
    options.mask = ctxpar::Mask::causal_mask();
    auto ring = ctxpar::Strategy::create(comm, options);
    const int64_t T = 64;
    Tensor q(ctxpar::DType::f32, {1, T, 2, 16}), k = q, v = q, out = q;
    fill_normal(q, 1), k = Tensor::copy_of(q), v = Tensor::copy_of(q), out = Tensor::copy_of(q);
    Tensor lse(ctxpar::DType::f32, {1, 2, T});
    std::vector<int64_t> pos(T);
    for (int64_t i = 0; i < T; ++i) pos[i] = comm.rank() * T + i;
    ring->forward(q, k, v, ctxpar::Tokens{pos, {}}, out, lse);
    if (comm.rank() == 1) throw ctxpar::Error("injected fault after the first forward");
    ring->forward(q, k, v, ctxpar::Tokens{pos, {}}, out, lse);
    std::this_thread::sleep_for(std::chrono::seconds(200));  // never reached on a correct abort
  };
  if (transport() == ctxpar::TransportKind::mpi)
    ctxpar::run_mpi(body);
  else
    ctxpar::run_gloo(world(), body);
  std::printf("rank %d: fault run returned; the job was not ended\n", world().rank());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (!ctxpar::launched_by_mpi() && !ctxpar::launched_by_torchrun()) {
    std::fprintf(stderr,
                 "test_mpi: run me under mpirun -n 2 (or 4), or torchrun --no-python "
                 "--nproc-per-node 2 (or 4)\n");
    return 2;
  }
  try {
    if (argc > 1 && !std::strcmp(argv[1], "--fault")) return fault();
    return compare_with_threads();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "test_mpi: rank %d: %s\n", world().rank(), e.what());
    return 1;
  }
}

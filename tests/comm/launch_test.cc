// The transports as a type (TransportKind, one capability row each), launch(kind, ranks, fn),
// and the environment read in one place (core/environment.h).
#include <gtest/gtest.h>

#include <cstdlib>
#include <initializer_list>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "core/environment.h"
#include "ctxpar/comm.h"
#include "ctxpar/launch.h"

namespace ctxpar {
namespace {

constexpr TransportKind kAll[] = {TransportKind::threads, TransportKind::mpi, TransportKind::gloo,
                                  TransportKind::nccl, TransportKind::loopback};

// Sets variables for one test and restores what was there before.
class ScopedEnv {
 public:
  ScopedEnv(std::initializer_list<std::pair<const char*, const char*>> vars) {
    for (const auto& [name, value] : vars) {
      const char* old = std::getenv(name);
      saved_.push_back({name, old ? std::optional<std::string>(old) : std::nullopt});
      if (value)
        setenv(name, value, 1);
      else
        unsetenv(name);
    }
  }
  ~ScopedEnv() {
    for (const auto& [name, old] : saved_) {
      if (old)
        setenv(name.c_str(), old->c_str(), 1);
      else
        unsetenv(name.c_str());
    }
  }

 private:
  std::vector<std::pair<std::string, std::optional<std::string>>> saved_;
};

TEST(TransportKind, EveryKindHasOneNameThatParsesBack) {
  std::set<std::string> names;
  for (TransportKind k : kAll) {
    EXPECT_EQ(parse_transport(transport_name(k)), k) << transport_name(k);
    names.insert(transport_name(k));
  }
  EXPECT_EQ(names, (std::set<std::string>{"threads", "mpi", "gloo", "nccl", "loopback"}));
  try {
    parse_transport("tcp");
    FAIL() << "an unknown name was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "unknown transport 'tcp': use threads, mpi, gloo, nccl or loopback");
  }
}

// The rows against what docs/comm.md and docs/cuda.md say of each transport.
TEST(TransportKind, CapabilityRowsSayWhatEachTransportNeeds) {
  struct Row {
    TransportKind kind;
    bool one_rank_per_process, needs_launcher, needs_gpu;
  };
  const Row documented[] = {{TransportKind::threads, false, false, false},
                            {TransportKind::mpi, true, true, false},
                            {TransportKind::gloo, true, true, false},
                            {TransportKind::nccl, true, true, true},
                            {TransportKind::loopback, false, false, true}};
  for (const Row& r : documented) {
    const TransportTraits& t = transport_traits(r.kind);
    EXPECT_EQ(t.one_rank_per_process, r.one_rank_per_process) << t.name;
    EXPECT_EQ(t.needs_launcher, r.needs_launcher) << t.name;
    EXPECT_EQ(t.needs_gpu, r.needs_gpu) << t.name;
  }
}

TEST(Launch, GpuTransportsRunOverTheirHostTransport) {
  ScopedEnv none{{"OMPI_COMM_WORLD_SIZE", nullptr}, {"PMI_SIZE", nullptr}, {"PMIX_RANK", nullptr}};
  EXPECT_EQ(host_transport(TransportKind::loopback), TransportKind::threads);
  EXPECT_EQ(host_transport(TransportKind::nccl), TransportKind::gloo);  // no mpirun: torchrun's
  for (TransportKind k : {TransportKind::threads, TransportKind::mpi, TransportKind::gloo})
    EXPECT_EQ(host_transport(k), k);
  ScopedEnv mpirun{{"OMPI_COMM_WORLD_SIZE", "2"}};
  EXPECT_EQ(host_transport(TransportKind::nccl), TransportKind::mpi);
}

TEST(Launch, ThreadsRunsEveryRankAndRethrowsARanksError) {
  std::vector<int> ran(3, 0);
  launch(TransportKind::threads, 3, [&](Communicator& comm) {
    EXPECT_EQ(comm.size(), 3);
    EXPECT_EQ(comm.transport(), TransportKind::threads);
    ++ran[comm.rank()];
  });
  EXPECT_EQ(ran, (std::vector<int>{1, 1, 1}));
  try {
    launch(TransportKind::loopback, 2, [](Communicator& comm) {
      if (comm.rank() == 1) throw Error("rank 1 gives up");
    });
    FAIL() << "a rank's error was lost";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1 gives up"), std::string::npos) << e.what();
  }
}

TEST(Environment, LauncherLocalRankIsTheFirstVariableSet) {
  ScopedEnv env{{"OMPI_COMM_WORLD_LOCAL_RANK", nullptr},
                {"MPI_LOCALRANKID", "3"},
                {"LOCAL_RANK", "1"},
                {"OMPI_COMM_WORLD_LOCAL_SIZE", nullptr},
                {"MPI_LOCALNRANKS", nullptr},
                {"LOCAL_WORLD_SIZE", "0"}};
  environment::Launcher l = environment::launcher();
  EXPECT_EQ(l.local_rank, 3);
  EXPECT_EQ(l.local_size, 1);  // at least one rank: this one
  ScopedEnv unset{
      {"MPI_LOCALRANKID", nullptr}, {"LOCAL_RANK", "-2"}, {"LOCAL_WORLD_SIZE", nullptr}};
  l = environment::launcher();
  EXPECT_EQ(l.local_rank, 0);
  EXPECT_EQ(l.local_size, 0);
  ScopedEnv none{{"LOCAL_RANK", nullptr}};
  EXPECT_EQ(environment::launcher().local_rank, -1);
}

TEST(Environment, GlooInterfaceBeforeHost) {
  ScopedEnv both{{"CTXPAR_GLOO_IFNAME", "eth7"}, {"CTXPAR_GLOO_HOST", "10.0.0.5"}};
  EXPECT_EQ(environment::gloo_interface(), "eth7");
  ScopedEnv host{{"CTXPAR_GLOO_IFNAME", ""}};
  EXPECT_EQ(environment::gloo_interface(), "10.0.0.5");
  ScopedEnv none{{"CTXPAR_GLOO_HOST", nullptr}};
  EXPECT_EQ(environment::gloo_interface(), "");
}

}  // namespace
}  // namespace ctxpar

// The rendezvous of gloo_from_torchrun_env (gloo_env.cc), split from reading the environment
// so that tests can run several ranks as threads of one process.
#pragma once
#include <chrono>
#include <memory>
#include <string>

#include "ctxpar/gloo.h"

namespace ctxpar::comm_detail {

struct TorchrunEnv {
  int rank = 0, size = 1;       // RANK, WORLD_SIZE
  std::string master;           // MASTER_ADDR
  int port = 0;                 // MASTER_PORT
  bool agent_store = false;     // TORCHELASTIC_USE_AGENT_STORE: torchrun's agent hosts the store
  std::string run_id, restart;  // TORCHELASTIC_RUN_ID, TORCHELASTIC_RESTART_COUNT ("" by hand)
  int call = 0;                 // which communicator of this process (keys of each apart)
};

// The environment's variables, each checked (a missing or inconsistent one throws naming it).
TorchrunEnv read_torchrun_env();

// Exchanges the ranks' gloo addresses through the TCP store at master:port (rank 0 hosting it
// unless the agent does) and connects them; the whole exchange ends within options.timeout.
// A rank waiting longer than `notice_after` says once on stderr what it waits for.
std::unique_ptr<Communicator> gloo_rendezvous(
    const TorchrunEnv& env, const GlooOptions& options,
    std::chrono::milliseconds notice_after = std::chrono::seconds(5));

}  // namespace ctxpar::comm_detail

// The gloo transport: one rank per process over TCP (Gloo's TCP transport, Debian's
// libgloo-dev), with no MPI at run time; for jobs started by torchrun, or by any launcher that
// can pass a few bytes between the processes. See docs/comm.md ("Gloo transport").
//
// Bootstrap is two-phase, so that any channel can carry the addresses:
//
//   GlooBootstrap boot(rank, size);            // listens on a TCP port
//   std::string mine = boot.address();         // opaque bytes (a few hundred per peer)
//   ... every rank learns every rank's address (a torch ProcessGroup's all_gather_object,
//       a TCP store, a file) ...
//   std::unique_ptr<Communicator> comm = boot.connect(addresses);   // addresses[r]: rank r's
//
// Under torchrun, gloo_from_torchrun_env() does all of it through the store torchrun's agent
// hosts at MASTER_ADDR:MASTER_PORT.
//
// The communicator keeps the Communicator contract (ctxpar/comm.h): the same collectives as
// the threads and MPI transports, over the same point-to-point, so every sum is bitwise equal
// to theirs; counters; a wait past the timeout throws naming rank, peer and tag; a rank whose
// peer exits or fails throws within seconds, naming that rank. Gloo's I/O thread moves the
// bytes, so a transfer progresses while the rank computes.
#pragma once
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "ctxpar/comm.h"

namespace ctxpar {

// The most ranks of a gloo communicator: each rank holds a listening socket and a connection
// per peer, and each address() holds an entry per peer, so the addresses exchanged grow as the
// square of the ranks (136 MiB at this bound, all through one TCP store under torchrun).
constexpr int kMaxGlooRanks = 1024;

struct GlooOptions {
  // The address to listen on and to publish: a host name, an IP address, or a network
  // interface ("eth0"). "" = auto: under gloo_from_torchrun_env the address from which
  // MASTER_ADDR is reached, else the address this host's name resolves to, else the loopback.
  // (The command and the Python package pass CTXPAR_GLOO_IFNAME or CTXPAR_GLOO_HOST here.)
  std::string hostname_or_interface;
  // The communicator's timeout (Communicator::set_timeout), how long connect() waits for the
  // peers, and the bound on making the pairs (one per peer) in the constructor.
  std::chrono::milliseconds timeout{120000};
};

// True when ctxpar was built with the gloo transport (CTXPAR_GLOO=ON, the default where
// libgloo-dev is installed).
bool gloo_available();

// Two-phase bootstrap of a gloo communicator of `size` ranks (see above). Each rank makes one,
// publishes address(), and calls connect() with every rank's address (its own included, at
// addresses[rank]). connect() may be called once.
class GlooBootstrap {
 public:
  GlooBootstrap(int rank, int size, const GlooOptions& options = {});
  ~GlooBootstrap();
  GlooBootstrap(const GlooBootstrap&) = delete;
  GlooBootstrap& operator=(const GlooBootstrap&) = delete;
  // Opaque bytes (not text: may hold any byte) for every peer.
  std::string address() const;
  // Connects to every other rank; returns when all pairs are connected (or throws, naming the
  // rank that could not be reached, after options.timeout).
  std::unique_ptr<Communicator> connect(const std::vector<std::string>& addresses);

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// torchrun's environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT are all set.
bool launched_by_torchrun();
// The communicator of this torchrun job: rank RANK of WORLD_SIZE, addresses exchanged through
// the TCP store at MASTER_ADDR:MASTER_PORT (torchrun's agent hosts it and sets
// TORCHELASTIC_USE_AGENT_STORE=True; without that variable rank 0 hosts it there, as torch's
// env:// init does). A missing or inconsistent variable throws ctxpar::Error naming it.
std::unique_ptr<Communicator> gloo_from_torchrun_env(const GlooOptions& options = {});

// The rank (of comm's world) whose failure this process has heard of: a peer's abort message,
// a lost connection, or this rank's own failure; -1 when none, or when comm is not a gloo
// communicator. Lets a launcher's error report name the rank that failed first.
int gloo_failed_rank(const Communicator& comm);

// Runs fn on `comm` (a gloo communicator). If fn throws, every other rank is told (its pending
// or next communication throws "rank Q: stopped because rank R failed: <message>"), this
// process prints "ctxpar: rank R failed: <message>" to stderr and exits with status 1.
void run_gloo(Communicator& comm, const std::function<void(Communicator&)>& fn);

}  // namespace ctxpar

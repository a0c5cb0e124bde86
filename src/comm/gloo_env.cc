// gloo_from_torchrun_env: a gloo communicator from torchrun's environment, the addresses
// exchanged through the c10d TCPStore at MASTER_ADDR:MASTER_PORT (tcp_store.h).
//
// Note [Claims keep two jobs apart]
// By hand (RANK etc. set without torchrun) nothing names the job, so two jobs on one
// MASTER_ADDR:MASTER_PORT would read each other's addresses. Every key is therefore claimed,
// never overwritten (COMPARE_SET: the first writer wins), under
// ctxpar/gloo/<run id>/<restart>/<call>/:
//   world   "<WORLD_SIZE> (set by rank R, pid P on HOST)": the first rank to arrive sets the job's
//           size; a rank with another WORLD_SIZE is refused naming both
//   <rank>  the rank's address(): a second process with the same RANK is refused, naming the
//           slot (the second job's rank 0 cannot host a store on the port in use)
// A refused rank leaves its slot holding "ctxpar-refused: <why>" (when still free), so that
// the ranks waiting for it stop at once naming why, instead of waiting out the timeout.
#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <map>
#include <optional>

#include "comm/gloo_env.h"
#include "comm/tcp_store.h"
#include "core/environment.h"
#include "ctxpar/gloo.h"

namespace ctxpar {
namespace comm_detail {

namespace {
constexpr const char* kRefused = "ctxpar-refused: ";
constexpr const char* kHowToLaunch =
    "start it with torchrun (torchrun --nproc-per-node N --no-python ctxpar ...), or set RANK, "
    "WORLD_SIZE, MASTER_ADDR and MASTER_PORT as torchrun does";

// `v`, the value of variable `name`, as a whole number in [lo, hi].
long env_int(const char* name, const std::string& v, long lo, long hi, const char* why = "") {
  CTXPAR_CHECK(!v.empty(), name, " is not set; ", kHowToLaunch);
  char* end = nullptr;
  const long n = std::strtol(v.c_str(), &end, 10);
  CTXPAR_CHECK(*end == '\0' && n >= lo && n <= hi, name,
               " must be a whole number "
               "in [",
               lo, ", ", hi, "]", why, ", got '", v, "'; ", kHowToLaunch);
  return n;
}

// The local address from which MASTER_ADDR is reached: where the other ranks can reach this
// one too, when they run on the master's network (a UDP connect sends nothing).
std::string address_towards(const std::string& host, int port) {
  addrinfo hints{}, *res = nullptr;
  hints.ai_socktype = SOCK_DGRAM;
  if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res) != 0) return "";
  std::string out;
  for (addrinfo* a = res; a && out.empty(); a = a->ai_next) {
    const int fd = ::socket(a->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    sockaddr_storage local{};
    socklen_t len = sizeof(local);
    char text[INET6_ADDRSTRLEN] = {};
    if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0 &&
        getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0 &&
        getnameinfo(reinterpret_cast<sockaddr*>(&local), len, text, sizeof(text), nullptr, 0,
                    NI_NUMERICHOST) == 0)
      out = text;
    ::close(fd);
  }
  freeaddrinfo(res);
  return out;
}

std::string this_host() {
  char name[256] = {};
  return gethostname(name, sizeof(name) - 1) == 0 ? name : "?";
}

std::string first_word(const std::string& s) { return s.substr(0, s.find(' ')); }
}  // namespace

TorchrunEnv read_torchrun_env() {
  const environment::Torchrun v = environment::torchrun();
  TorchrunEnv e;
  e.size = static_cast<int>(env_int("WORLD_SIZE", v.world_size, 1, kMaxGlooRanks,
                                    " (kMaxGlooRanks: the gloo transport's bound)"));
  e.rank = static_cast<int>(env_int("RANK", v.rank, 0, 1 << 20));
  CTXPAR_CHECK(e.rank < e.size, "RANK=", e.rank, " is not below WORLD_SIZE=", e.size,
               "; the launcher's environment is inconsistent: ", kHowToLaunch);
  if (!v.local_rank.empty() && !v.local_world_size.empty()) {
    const long local = env_int("LOCAL_RANK", v.local_rank, 0, 1 << 20);
    const long local_size = env_int("LOCAL_WORLD_SIZE", v.local_world_size, 1, 1 << 20);
    CTXPAR_CHECK(local < local_size && local_size <= e.size, "LOCAL_RANK=", local,
                 " / LOCAL_WORLD_SIZE=", local_size, " do not fit WORLD_SIZE=", e.size,
                 "; the launcher's environment is inconsistent: ", kHowToLaunch);
  }
  e.master = v.master_addr;
  CTXPAR_CHECK(!e.master.empty(), "MASTER_ADDR is not set (the host of the job's TCP store); ",
               kHowToLaunch);
  e.port = static_cast<int>(env_int("MASTER_PORT", v.master_port, 1, 65535));
  // torchrun's agent hosts the store and says so; otherwise rank 0 hosts it, as torch's env://
  // does.
  const std::string& agent = v.use_agent_store;
  e.agent_store = agent == "True" || agent == "true" || agent == "1";
  e.run_id = v.run_id;
  e.restart = v.restart_count;
  return e;
}

std::unique_ptr<Communicator> gloo_rendezvous(const TorchrunEnv& env, const GlooOptions& options,
                                              std::chrono::milliseconds notice_after) {
  GlooOptions o = options;
  if (o.hostname_or_interface.empty())
    o.hostname_or_interface = address_towards(env.master, env.port);

  // Note [Claims keep two jobs apart]. Keys are also unique per run, restart and call, so a
  // restarted job or a second communicator never reads a stale address.
  const std::string prefix =
      "ctxpar/gloo/" + env.run_id + "/" + env.restart + "/" + std::to_string(env.call) + "/";
  const std::string my_world = detail::concat(env.size, " (set by rank ", env.rank, ", pid ",
                                              ::getpid(), " on ", this_host(), ")");
  const std::string me = "rank " + std::to_string(env.rank);
  // The rank that hosts the store sets the job's size before any other rank can connect.
  std::optional<TcpStoreServer> server;
  if (env.rank == 0 && !env.agent_store)
    server.emplace(env.master, env.port,
                   std::map<std::string, std::string>{{prefix + "world", my_world}});
  TcpStoreClient store(env.master, env.port, o.timeout, me,
                       env.agent_store ? "torchrun's agent's" : "rank 0's", notice_after);
  const std::string where = "the TCP store at " + store.where() + " (MASTER_ADDR:MASTER_PORT)";
  auto refuse = [&](const std::string& why) {
    try {
      store.claim(prefix + std::to_string(env.rank), kRefused + why);
    } catch (const Error&) {  // the store is gone: this rank's own error is what matters
    }
    throw Error(why);
  };
  const std::string world = store.claim(prefix + "world", my_world);
  if (first_word(world) != std::to_string(env.size))
    refuse(detail::concat(me, ": WORLD_SIZE=", env.size, " here, but the job at ", where,
                          " has WORLD_SIZE=", printable(world, 200),
                          "; start every rank "
                          "with the same WORLD_SIZE, and give each job a MASTER_PORT of its own"));

  GlooBootstrap boot(env.rank, env.size, o);
  const std::string mine = boot.address();
  if (store.claim(prefix + std::to_string(env.rank), mine) != mine)
    throw Error(detail::concat(
        me, ": another process already joined the job at ", where, " as rank ", env.rank, " (key '",
        prefix, env.rank,
        "'); two jobs share MASTER_ADDR:MASTER_PORT, or two "
        "processes have RANK=",
        env.rank,
        ": give each job a MASTER_PORT of its own (or a "
        "TORCHELASTIC_RUN_ID of its own on all its ranks), and each process its own RANK"));
  std::vector<std::string> addresses(env.size);
  for (int j = 0; j < env.size; ++j) {
    if (j == env.rank) {
      addresses[j] = mine;
      continue;
    }
    const std::string key = prefix + std::to_string(j);
    addresses[j] = store.get(key, detail::concat("rank ", j, " of WORLD_SIZE=", env.size,
                                                 " to join (its address, key '", key, "')"));
    if (addresses[j].rfind(kRefused, 0) == 0)
      throw Error(detail::concat(
          me, ": rank ", j,
          " could not join: ", printable(addresses[j].substr(std::string(kRefused).size()), 1000)));
  }
  auto comm = boot.connect(addresses);
  // Every rank has read every address once every pair is connected; rank 0 may stop serving.
  comm->barrier();
  comm->reset_counters();
  return comm;
}

}  // namespace comm_detail

std::unique_ptr<Communicator> gloo_from_torchrun_env(const GlooOptions& options) {
  comm_detail::TorchrunEnv env = comm_detail::read_torchrun_env();
  static int calls = 0;
  env.call = calls++;
  return comm_detail::gloo_rendezvous(env, options);
}

}  // namespace ctxpar

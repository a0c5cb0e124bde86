// GlooBootstrap: the two-phase connection of a gloo communicator (ctxpar/gloo.h).
//
// Each rank opens a Gloo TCP device (one listening socket) and a transport context with one
// pair per other rank. Its address() lists, for every other rank j, the address of the pair
// that waits for j; connect() hands each pair the entry that its peer made for this rank.
// The bytes of address(): gloo_address.h.
#include <fcntl.h>
#include <gloo/transport/tcp/address.h>
#include <gloo/transport/tcp/attr.h>
#include <gloo/transport/tcp/device.h>
#include <net/if.h>
#include <netdb.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdlib>
#include <cstring>

#include "comm/gloo_address.h"
#include "comm/gloo_world.h"
#include "ctxpar/gloo.h"

namespace ctxpar {

namespace {
using Clock = std::chrono::steady_clock;
constexpr char kMagic[8] = {'C', 'T', 'X', 'P', 'A', 'R', 'G', '1'};

void put_u32(std::string& out, uint32_t v) { out.append(reinterpret_cast<const char*>(&v), 4); }
uint32_t get_u32(const std::string& in, size_t at) {
  uint32_t v = 0;
  std::memcpy(&v, in.data() + at, 4);
  return v;
}

// Where to listen: an interface name, else a host name or address; "" picks this host's name
// (if it resolves), else the loopback. (CTXPAR_GLOO_IFNAME / _HOST reach `given` from the
// command and the Python package: environment::gloo_interface.)
gloo::transport::tcp::attr device_attr(const std::string& given) {
  gloo::transport::tcp::attr attr;
  std::string what = given;
  if (!what.empty() && if_nametoindex(what.c_str()) != 0) {
    attr.iface = what;
    return attr;
  }
  if (what.empty()) {
    char name[256] = {};
    addrinfo* res = nullptr;
    if (gethostname(name, sizeof(name) - 1) == 0 &&
        getaddrinfo(name, nullptr, nullptr, &res) == 0) {
      freeaddrinfo(res);
      what = name;
    } else {
      what = "127.0.0.1";
    }
  }
  attr.hostname = what;
  return attr;
}

// Note [A closed peer is an error, not SIGPIPE]
// Gloo's TCP pairs write with writev(), which raises SIGPIPE when the peer has closed its end:
// a rank whose peer failed would be killed by the signal (exit 141, no message) instead of
// failing with "lost the connection to rank N". Python ignores SIGPIPE from start-up, so only
// C++ programs (the ctxpar command, the tests) could see it: seen once in 40 runs of
// Gloo.APeerThatGoesAwayStopsTheOthersNamingIt. A gloo communicator therefore sets SIGPIPE
// to SIG_IGN where it is still SIG_DFL (a program's own handler is left alone); every write
// then fails with EPIPE, which Gloo turns into the error its waits report.
void ignore_sigpipe_if_default() {
  struct sigaction now = {};
  if (sigaction(SIGPIPE, nullptr, &now) == 0 && now.sa_handler == SIG_DFL) {
    struct sigaction ign = {};
    ign.sa_handler = SIG_IGN;
    sigemptyset(&ign.sa_mask);
    sigaction(SIGPIPE, &ign, nullptr);
  }
}
}  // namespace

namespace comm_detail {

GlooAddress parse_gloo_address(const std::string& s, int j, int size, size_t entry_bytes) {
  const std::string which = detail::concat("GlooBootstrap::connect: addresses[", j, "]");
  const bool magic = s.size() >= 16 && std::memcmp(s.data(), kMagic, 8) == 0;
  CTXPAR_CHECK(
      magic && get_u32(s, 8) == uint32_t(j) && get_u32(s, 12) == uint32_t(size), which,
      " is not the address() of rank ", j, " of ", size, " (", s.size(), " bytes",
      magic ? detail::concat(", from rank ", get_u32(s, 8), " of ", get_u32(s, 12)) : std::string(),
      "); pass every rank's address() in rank order");
  CTXPAR_CHECK(s.size() >= 20, which, " is truncated (", s.size(),
               " bytes, where its header "
               "alone is 20); pass the bytes of address() unchanged");
  // Each address's own entry size: the entries of one address are never read with another's.
  const uint64_t entry = get_u32(s, 16);
  CTXPAR_CHECK(entry == entry_bytes, which, " has entries of ", entry,
               " bytes, where this "
               "build's are ",
               entry_bytes,
               "; pass the bytes of address() unchanged, from "
               "ranks that run the same ctxpar");
  const uint64_t tail = 20 + entry * (size - 1);
  CTXPAR_CHECK(s.size() >= tail + 4 && s.size() == tail + 4 + get_u32(s, tail), which,
               " is truncated or damaged (", s.size(), " bytes, where ", size - 1, " entries of ",
               entry, " bytes need ", tail + 4,
               " and its listen text); pass the bytes of address() unchanged");
  GlooAddress a;
  a.listen = s.substr(tail + 4);
  CTXPAR_CHECK(
      std::all_of(a.listen.begin(), a.listen.end(), [](char c) { return c >= 0x20 && c < 0x7f; }),
      which,
      "'s listen address is not printable text; pass the bytes of address() "
      "unchanged");
  for (int k = 0; k + 1 < size; ++k) {
    const std::vector<char> e(s.begin() + 20 + k * entry, s.begin() + 20 + (k + 1) * entry);
    const int family = gloo::transport::tcp::Address(e).getSockaddr().ss_family;
    CTXPAR_CHECK(family == AF_INET || family == AF_INET6, which, ": its entry for rank ",
                 k + (k >= j ? 1 : 0), " is not an IPv4 or IPv6 socket address (family ", family,
                 "); pass the bytes of address() unchanged");
    a.entries.emplace_back(e.begin(), e.end());
  }
  return a;
}

}  // namespace comm_detail

bool gloo_available() { return true; }

struct GlooBootstrap::State {
  std::shared_ptr<comm_detail::GlooWorld> world;
  GlooOptions options;
  std::string address;
  size_t entry_bytes = 0;  // of this rank's entries: every rank's must be the same
  bool connected = false;
};

GlooBootstrap::GlooBootstrap(int rank, int size, const GlooOptions& options)
    : state_(std::make_unique<State>()) {
  CTXPAR_CHECK(size >= 1 && size <= kMaxGlooRanks, "GlooBootstrap: size must be in [1, ",
               kMaxGlooRanks,
               "] (kMaxGlooRanks: each rank holds a socket per peer, and the "
               "addresses exchanged grow as size squared), got ",
               size);
  CTXPAR_CHECK(rank >= 0 && rank < size, "GlooBootstrap: rank must be in [0, ", size, "), got ",
               rank);
  CTXPAR_CHECK(options.timeout.count() > 0, "GlooBootstrap: timeout must be positive, got ",
               options.timeout.count(), " ms");
  state_->options = options;
  ignore_sigpipe_if_default();  // Note [A closed peer is an error, not SIGPIPE]
  auto w = std::make_shared<comm_detail::GlooWorld>();
  w->rank = rank;
  w->size = size;
  const auto attr = device_attr(options.hostname_or_interface);
  const std::string where =
      attr.iface.empty() ? "host '" + attr.hostname + "'" : "interface '" + attr.iface + "'";
  // libgloo's CreateDevice may crash (SIGSEGV in CreateDeviceAttr) instead of throwing on a
  // host name that does not resolve: the name is resolved here first.
  std::string why;
  if (attr.iface.empty()) {
    addrinfo* found = nullptr;
    if (const int rc = getaddrinfo(attr.hostname.c_str(), nullptr, nullptr, &found); rc != 0)
      why = std::string("the name does not resolve (") + gai_strerror(rc) + ")";
    else
      freeaddrinfo(found);
  }
  if (why.empty()) {
    try {
      w->device = gloo::transport::tcp::CreateDevice(attr);
    } catch (const std::exception& e) {
      why = e.what();
    }
  }
  if (!why.empty())
    throw Error(detail::concat("gloo: rank ", rank, " cannot listen on ", where, ": ", why,
                               "; set GlooOptions::hostname_or_interface (or CTXPAR_GLOO_IFNAME="
                               "<interface>, CTXPAR_GLOO_HOST=<address>) to one of this host's"));
  if (::pipe2(w->teardown_tick, O_CLOEXEC | O_NONBLOCK) != 0)  // (without it: the slow way)
    w->teardown_tick[0] = w->teardown_tick[1] = -1;
  w->context = w->device->createContext(rank, size);
  w->context->setTimeout(options.timeout);
  std::string& a = state_->address;
  a.append(kMagic, sizeof(kMagic));
  put_u32(a, rank);
  put_u32(a, size);
  std::string listen = w->device->str();
  // Each pair listens on a socket of its own; on a busy host that may take long: never past
  // the timeout.
  const auto deadline = Clock::now() + options.timeout;
  bool first = true;
  for (int j = 0; j < size; ++j) {
    if (j == rank) continue;
    CTXPAR_CHECK(Clock::now() < deadline, "gloo: rank ", rank, " made only ", j - (j > rank),
                 " of its ", size - 1,
                 " pairs (one listening socket per peer) within the "
                 "timeout of ",
                 options.timeout.count() / 1000.0,
                 " s; use fewer ranks, or a "
                 "longer timeout");
    std::vector<char> bytes;
    try {
      bytes = w->context->createPair(j)->address().bytes();
    } catch (const std::exception& e) {  // Gloo's enforce: out of descriptors, most likely
      throw Error(detail::concat("gloo: rank ", rank, " could not make its pair for rank ", j,
                                 " of ", size, " (", e.what(),
                                 "); each rank holds a socket per "
                                 "peer: raise the open-file limit (ulimit -n), or use fewer "
                                 "ranks"));
    }
    if (first) put_u32(a, static_cast<uint32_t>(bytes.size()));
    first = false;
    state_->entry_bytes = bytes.size();
    a.append(bytes.data(), bytes.size());
  }
  if (first) put_u32(a, 0);
  put_u32(a, static_cast<uint32_t>(listen.size()));
  a += listen;
  state_->world = std::move(w);
}

GlooBootstrap::~GlooBootstrap() = default;

std::string GlooBootstrap::address() const { return state_->address; }

std::unique_ptr<Communicator> GlooBootstrap::connect(const std::vector<std::string>& addresses) {
  auto& w = *state_->world;
  CTXPAR_CHECK(!state_->connected, "GlooBootstrap::connect: called twice (it may be called once)");
  CTXPAR_CHECK(static_cast<int>(addresses.size()) == w.size, "GlooBootstrap::connect: expected ",
               w.size, " addresses (one per rank), got ", addresses.size());
  std::vector<comm_detail::GlooAddress> peers(w.size);
  for (int j = 0; j < w.size; ++j)
    peers[j] = comm_detail::parse_gloo_address(addresses[j], j, w.size, state_->entry_bytes);
  for (int j = 0; j < w.size; ++j) {
    if (j == w.rank) continue;
    // Rank j's entries skip itself: the one for this rank is at index rank - (rank > j).
    const std::string& entry = peers[j].entries[w.rank - (w.rank > j ? 1 : 0)];
    try {
      w.context->getPair(j)->connect(std::vector<char>(entry.begin(), entry.end()));
    } catch (const std::exception& e) {
      throw Error(detail::concat(
          "gloo: rank ", w.rank, " could not connect to rank ", j, " (", peers[j].listen,
          ") within ", state_->options.timeout.count() / 1000.0, " s: ", e.what(), "; is rank ", j,
          " running, and is its address "
          "reachable from here (GlooOptions::hostname_or_interface, "
          "CTXPAR_GLOO_IFNAME)?"));
    }
  }
  state_->connected = true;
  w.connected = true;
  w.start_abort_listener();
  auto comm = comm_detail::make_gloo_communicator(state_->world);
  comm->set_timeout(state_->options.timeout);
  return comm;
}

}  // namespace ctxpar

// GlooBootstrap: the two-phase connection of a gloo communicator (ctxpar/gloo.h).
//
// Each rank opens a Gloo TCP device (one listening socket) and a transport context with one
// pair per other rank. Its address() lists, for every other rank j, the address of the pair
// that waits for j; connect() hands each pair the entry that its peer made for this rank.
//
//   address(): "CTXPARG1" | rank u32 | size u32 | entry bytes u32 | entries (j != rank, in
//              order) | listen address text (for errors)
#include <gloo/transport/tcp/attr.h>
#include <gloo/transport/tcp/device.h>
#include <net/if.h>
#include <netdb.h>
#include <unistd.h>

#include <csignal>
#include <cstdlib>
#include <cstring>

#include "comm/gloo_world.h"
#include "ctxpar/gloo.h"

namespace ctxpar {

namespace {
constexpr char kMagic[8] = {'C', 'T', 'X', 'P', 'A', 'R', 'G', '1'};

void put_u32(std::string& out, uint32_t v) { out.append(reinterpret_cast<const char*>(&v), 4); }
uint32_t get_u32(const std::string& in, size_t at) {
  uint32_t v = 0;
  std::memcpy(&v, in.data() + at, 4);
  return v;
}

// Where to listen: an interface name, else a host name or address; "" picks
// CTXPAR_GLOO_IFNAME, CTXPAR_GLOO_HOST, this host's name (if it resolves), else the loopback.
gloo::transport::tcp::attr device_attr(const std::string& given) {
  gloo::transport::tcp::attr attr;
  std::string what = given;
  if (what.empty()) {
    if (const char* v = std::getenv("CTXPAR_GLOO_IFNAME"); v && *v) what = v;
    else if (const char* h = std::getenv("CTXPAR_GLOO_HOST"); h && *h) what = h;
  }
  if (!what.empty() && if_nametoindex(what.c_str()) != 0) {
    attr.iface = what;
    return attr;
  }
  if (what.empty()) {
    char name[256] = {};
    addrinfo* res = nullptr;
    if (gethostname(name, sizeof(name) - 1) == 0 && getaddrinfo(name, nullptr, nullptr, &res) == 0) {
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

bool gloo_available() { return true; }

struct GlooBootstrap::State {
  std::shared_ptr<comm_detail::GlooWorld> world;
  GlooOptions options;
  std::string address;
  bool connected = false;
};

GlooBootstrap::GlooBootstrap(int rank, int size, const GlooOptions& options)
    : state_(std::make_unique<State>()) {
  CTXPAR_CHECK(size >= 1, "GlooBootstrap: size must be >= 1, got ", size);
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
  const std::string where = attr.iface.empty() ? "host '" + attr.hostname + "'"
                                               : "interface '" + attr.iface + "'";
  try {
    w->device = gloo::transport::tcp::CreateDevice(attr);
  } catch (const std::exception& e) {
    throw Error(detail::concat("gloo: rank ", rank, " cannot listen on ", where, ": ", e.what(),
                               "; set GlooOptions::hostname_or_interface (or CTXPAR_GLOO_IFNAME="
                               "<interface>, CTXPAR_GLOO_HOST=<address>) to one of this host's"));
  }
  w->context = w->device->createContext(rank, size);
  w->context->setTimeout(options.timeout);
  std::string& a = state_->address;
  a.append(kMagic, sizeof(kMagic));
  put_u32(a, rank);
  put_u32(a, size);
  std::string listen = w->device->str();
  bool first = true;
  for (int j = 0; j < size; ++j) {
    if (j == rank) continue;
    const std::vector<char> bytes = w->context->createPair(j)->address().bytes();
    if (first) put_u32(a, static_cast<uint32_t>(bytes.size()));
    first = false;
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
  std::vector<std::string> listen(w.size);
  size_t entry = 0;
  for (int j = 0; j < w.size; ++j) {
    const std::string& s = addresses[j];
    const bool ok = s.size() >= 20 && std::memcmp(s.data(), kMagic, 8) == 0 &&
                    get_u32(s, 8) == uint32_t(j) && get_u32(s, 12) == uint32_t(w.size);
    CTXPAR_CHECK(ok, "GlooBootstrap::connect: addresses[", j, "] is not the address() of rank ",
                 j, " of ", w.size, " (", s.size(), " bytes", s.size() >= 16 ? detail::concat(
                 ", from rank ", get_u32(s, 8), " of ", get_u32(s, 12)) : std::string(),
                 "); pass every rank's address() in rank order");
    entry = get_u32(s, 16);
    const size_t tail = 20 + entry * (w.size - 1);
    CTXPAR_CHECK(s.size() >= tail + 4 && s.size() == tail + 4 + get_u32(s, tail),
                 "GlooBootstrap::connect: addresses[", j, "] is truncated or damaged (",
                 s.size(), " bytes); pass the bytes of address() unchanged");
    listen[j] = s.substr(tail + 4);
  }
  for (int j = 0; j < w.size; ++j) {
    if (j == w.rank) continue;
    // Rank j's entries skip itself: the one for this rank is at index rank - (rank > j).
    const int index = w.rank - (w.rank > j ? 1 : 0);
    const std::string& s = addresses[j];
    const std::vector<char> bytes(s.begin() + 20 + index * entry,
                                  s.begin() + 20 + (index + 1) * entry);
    try {
      w.context->getPair(j)->connect(bytes);
    } catch (const std::exception& e) {
      throw Error(detail::concat("gloo: rank ", w.rank, " could not connect to rank ", j, " (",
                                 listen[j], ") within ", state_->options.timeout.count() / 1000.0,
                                 " s: ", e.what(), "; is rank ", j, " running, and is its address "
                                 "reachable from here (GlooOptions::hostname_or_interface, "
                                 "CTXPAR_GLOO_IFNAME)?"));
    }
  }
  state_->connected = true;
  w.start_abort_listener();
  auto comm = comm_detail::make_gloo_communicator(state_->world);
  comm->set_timeout(state_->options.timeout);
  return comm;
}

}  // namespace ctxpar

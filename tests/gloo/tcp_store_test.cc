// The gloo bootstrap under hostile input (issue 34): GlooBootstrap::connect checks every
// address on its own, its size is bounded, and its pairs go away at once.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <thread>

#include "comm/gloo_address.h"
#include "ctxpar/gloo.h"

namespace ctxpar::comm_detail {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;
using std::chrono::seconds;

// Bounds for a store that answers at once: generous for a loaded machine, far below the hangs
// they catch (a wedged store thread held the process until the stray client left, 100 s).
constexpr auto kPrompt = seconds(2);

// ---- GlooBootstrap: every address checked on its own (item 7) ----------------------------

struct ThreeRanks {
  std::vector<std::unique_ptr<GlooBootstrap>> boots;
  std::vector<std::string> addresses;
  ThreeRanks() {
    GlooOptions o;
    o.hostname_or_interface = "127.0.0.1";
    o.timeout = seconds(2);
    for (int r = 0; r < 3; ++r) {
      boots.push_back(std::make_unique<GlooBootstrap>(r, 3, o));
      addresses.push_back(boots.back()->address());
    }
  }
};

uint32_t u32_at(const std::string& s, size_t at) {
  uint32_t v = 0;
  std::memcpy(&v, s.data() + at, 4);
  return v;
}
void set_u32(std::string& s, size_t at, uint32_t v) { std::memcpy(s.data() + at, &v, 4); }

// Rank j's address rebuilt with entries of `entry` bytes (each a prefix of the real one, or
// padded with zeros), consistent in itself: only its entry size differs from the others'.
std::string with_entry_size(const std::string& real, int size, uint32_t entry) {
  const uint32_t e = u32_at(real, 16);
  std::string out = real.substr(0, 20);
  set_u32(out, 16, entry);
  for (int k = 0; k + 1 < size; ++k) {
    std::string one = real.substr(20 + k * e, e);
    one.resize(entry, '\0');
    out += one;
  }
  return out + real.substr(20 + e * (size - 1));
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// Every peer's entries were sliced with the *last* address's entry size: a short address 1
// before a real address 2 was read past its end (66 invalid reads under valgrind).
TEST(GlooBootstrap, ConnectChecksEveryAddressOnItsOwn) {
  ThreeRanks t;
  const uint32_t real = u32_at(t.addresses[1], 16);
  ASSERT_GT(real, 8u);
  std::vector<std::string> crafted = t.addresses;
  crafted[1] = with_entry_size(t.addresses[1], 3, 8);
  const std::string e = error_of([&] { t.boots[0]->connect(crafted); });
  EXPECT_NE(e.find("addresses[1] has entries of 8 bytes, where this build's are " +
                   std::to_string(real)), std::string::npos) << e;
}

TEST(GlooAddress, EachEntryIsCheckedOnItsOwn) {
  ThreeRanks t;
  const std::string& a = t.addresses[2];
  const size_t entry = u32_at(a, 16);
  const GlooAddress ok = parse_gloo_address(a, 2, 3, entry);
  ASSERT_EQ(ok.entries.size(), 2u);
  EXPECT_EQ(ok.entries[1], a.substr(20 + entry, entry));
  EXPECT_EQ(ok.listen, a.substr(20 + 2 * entry + 4));
  auto refused = [&](std::string bytes, const std::string& why) {
    const std::string e = error_of([&] { parse_gloo_address(bytes, 2, 3, entry); });
    EXPECT_NE(e.find("addresses[2]"), std::string::npos) << e;
    EXPECT_NE(e.find(why), std::string::npos) << e;
  };
  refused(a.substr(0, 15), "is not the address() of rank 2 of 3 (15 bytes)");
  refused(a.substr(0, 19), "is truncated (19 bytes, where its header alone is 20)");
  refused(t.addresses[1], "from rank 1 of 3");
  refused(with_entry_size(a, 3, uint32_t(entry + 8)), "has entries of " + std::to_string(entry + 8));
  refused(with_entry_size(a, 3, 0), "has entries of 0 bytes");
  refused(a.substr(0, a.size() - 1), "is truncated or damaged");
  refused(a + "x", "is truncated or damaged");
  std::string huge_listen = a;
  set_u32(huge_listen, 20 + 2 * entry, 0xffffffffu);  // listen length past the end
  refused(huge_listen, "is truncated or damaged");
  std::string escape = a;
  escape.back() = '\x1b';  // a terminal escape in the text an error would print
  refused(escape, "listen address is not printable");
  std::string family = a;
  std::memset(family.data() + 20 + entry, 0x7f, 2);  // the second entry's address family
  refused(family, "its entry for rank 1 is not an IPv4 or IPv6 socket address");
}

// Item 9: WORLD_SIZE=50000 built a pair per rank, ten a second, ignoring the timeout.
TEST(GlooBootstrap, SizeIsBoundedAndThePairsByTheTimeout) {
  GlooOptions o;
  o.hostname_or_interface = "127.0.0.1";
  std::string e = error_of([&] { GlooBootstrap(0, 50000, o); });
  EXPECT_NE(e.find("size must be in [1, " + std::to_string(kMaxGlooRanks) + "]"),
            std::string::npos) << e;
  // 1023 listening sockets take tens of milliseconds; the timeout is one.
  o.timeout = milliseconds(1);
  e = error_of([&] { GlooBootstrap(0, kMaxGlooRanks, o); });
  EXPECT_NE(e.find("pairs (one listening socket per peer) within the timeout of 0.001 s"),
            std::string::npos) << e;
}

// Gloo's pairs went away at 10 ms each (Note [Gloo's teardown waits a tick per pair]): a failed
// rendezvous of kMaxGlooRanks ranks held its process 10 s after the error, whatever the timeout.
TEST(GlooBootstrap, ABootstrapOfManyRanksGoesAwayAtOnce) {
  GlooOptions o;
  o.hostname_or_interface = "127.0.0.1";
  auto boot = std::make_unique<GlooBootstrap>(0, kMaxGlooRanks, o);
  const auto start = Clock::now();
  boot.reset();
  EXPECT_LT(Clock::now() - start, kPrompt) << "10 ms per pair would be 10 s";
}

}  // namespace
}  // namespace ctxpar::comm_detail

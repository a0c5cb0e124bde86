// The bytes of GlooBootstrap::address() (gloo_bootstrap.cc), read back from whatever channel
// carried them (a TCP store anyone on the network may write to, a torch all_gather_object):
//
//   "CTXPARG1" | rank u32 | size u32 | entry bytes u32 | entries (one per rank j != rank, in
//   order, each `entry bytes` long: Gloo's address of the pair that waits for j) | listen
//   text length u32 | listen text ("host:port", for errors)
#pragma once
#include <cstddef>
#include <string>
#include <vector>

namespace ctxpar::comm_detail {

struct GlooAddress {
  std::vector<std::string> entries;  // entries[k]: the pair for the k-th other rank
  std::string listen;                // printable "host:port"
};

// Reads rank j's address as this build wrote it: magic, rank j of `size`, entries of exactly
// `entry_bytes` (Gloo's TCP address size, each an IPv4 or IPv6 socket address), the lengths
// adding up to the size, a printable listen text. Each address is checked on its own; throws
// ctxpar::Error naming addresses[j] and what is wrong.
GlooAddress parse_gloo_address(const std::string& bytes, int j, int size, size_t entry_bytes);

}  // namespace ctxpar::comm_detail

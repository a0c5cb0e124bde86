// Cross-rank agreement: before a collective call communicates, every rank shares its verdict on
// its own arguments and a signature of what must be equal on every rank, so that a rank with
// bad arguments, or with other shapes or options, fails every rank at once, naming the rank or
// the field, instead of a hang or a silently wrong answer. One function for every caller: the
// strategies (each forward / backward, and create), `ctxpar attention` and `ctxpar train` under
// mpirun (which say the field as their option's flag) and the Python package.
//
// Cost: one allgather of a fixed 464-byte verdict per rank (the local error, a hash and the
// length of the signature); the signatures themselves travel, in one more allgather, only when
// the hashes differ (kMaxThreadsRanks in comm.h: what one rank holds about all others adds up
// to P x P in one process).
#pragma once
#include <string>
#include <utility>
#include <vector>

#include "ctxpar/comm.h"

namespace ctxpar {

// (field, canonical value text) pairs, in a fixed order. An empty value reads "(not given)".
using Signature = std::vector<std::pair<std::string, std::string>>;

// What the ranks found. failed_ranks: the ranks whose local error was not empty (error: the
// lowest one's). Else field: the first field, in rank 0's order, whose value differs on some
// rank (then fields rank 0 does not have); rank: the first rank that differs in it.
struct Agreement {
  std::vector<int> failed_ranks;
  std::string error;
  std::string field, value0, value;
  int rank = -1;
  int ranks = 0;
  bool agreed() const { return failed_ranks.empty() && field.empty(); }
  // "mask is causal on rank 0 but none on rank 1" ("" when the signatures agree).
  std::string difference() const;
};

// Collective on every rank of `comm`, before any other communication of the call.
Agreement agree_across_ranks(Communicator& comm, const Signature& mine,
                             const std::string& local_error = "");

// agree_across_ranks, then the same ctxpar::Error on every rank unless agreed:
//   "<what>: invalid arguments on rank 1, 3 (of 4): <rank 1's error>"
//   "<what>: the ranks were called with different arguments: <difference()>; every rank of
//    the communicator must pass the same"
void require_agreement(Communicator& comm, const std::string& what, const Signature& mine,
                       const std::string& local_error = "");

}  // namespace ctxpar

// Under mpirun every process parses its own command line (`ctxpar attention`, `ctxpar train`), and an MPMD line
// (`mpirun -n 1 ctxpar attention A : -n 1 ctxpar attention B`) can start ranks with different
// options: different layouts gave a wrong answer with exit 0, an option only one rank had
// (--check) a hang until the timeout. So before any work the ranks exchange a signature of
// every option that changes the answer or the messages they send, and refuse a difference,
// naming the option.
#pragma once
#include <string>
#include <utility>
#include <vector>

#include "ctxpar/comm.h"

namespace ctxpar::cli {

// (option, canonical value) pairs, in a fixed order.
using Signature = std::vector<std::pair<std::string, std::string>>;

// One allgather of every rank's signature. Throws UsageError on every rank (the same message)
// naming the first option that differs, its value on rank 0 and on the first rank that
// differs.
void agree_across_ranks(Communicator& comm, const Signature& mine,
                        const std::string& command = "attention");

// A short fingerprint of a file that every rank can take without reading the whole file:
// its size and a hash of up to 16 evenly spaced 4 KiB blocks (the same blocks on every rank).
std::string file_fingerprint(const std::string& path);
// FNV-1a hash of bytes, as 16 hex digits.
std::string hash_hex(const void* data, size_t bytes);

}  // namespace ctxpar::cli

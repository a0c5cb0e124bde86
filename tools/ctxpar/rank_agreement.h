// Under mpirun every process parses its own command line (`ctxpar attention`, `ctxpar train`), and an MPMD line
// (`mpirun -n 1 ctxpar attention A : -n 1 ctxpar attention B`) can start ranks with different
// options: different layouts gave a wrong answer with exit 0, an option only one rank had
// (--check) a hang until the timeout. So before any work the ranks agree on a signature of
// every option that changes the answer or the messages they send (the library's
// agree_across_ranks, include/ctxpar/agreement.h: fields named after the options), and refuse
// a difference, naming the option.
#pragma once
#include <string>

#include "ctxpar/agreement.h"
#include "ctxpar/comm.h"

namespace ctxpar::cli {

// agree_across_ranks on (option without "--", canonical value) fields. Throws UsageError on
// every rank (the same message) naming the first option that differs as its flag, its value on
// rank 0 and on the first rank that differs.
void agree_on_options(Communicator& comm, const Signature& mine,
                      const std::string& command = "attention");

// A short fingerprint of a file that every rank can take without reading the whole file:
// its size and a hash of up to 16 evenly spaced 4 KiB blocks (the same blocks on every rank).
std::string file_fingerprint(const std::string& path);
// FNV-1a hash of bytes, as 16 hex digits.
std::string hash_hex(const void* data, size_t bytes);

}  // namespace ctxpar::cli

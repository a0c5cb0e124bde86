#include "rank_agreement.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>

#include "ctxpar/hash.h"
#include "options.h"

namespace ctxpar::cli {

std::string hash_hex(const void* data, size_t bytes) {
  const uint64_t h = fnv1a64(data, bytes);
  char s[17];
  std::snprintf(s, sizeof s, "%016llx", static_cast<unsigned long long>(h));
  return s;
}

std::string file_fingerprint(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  struct stat st = {};
  if (fd < 0 || fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    if (fd >= 0) close(fd);
    return "unreadable";  // the reader names the problem; ranks still compare the path
  }
  constexpr uint64_t kBlock = 4096, kBlocks = 16;
  const auto size = static_cast<uint64_t>(st.st_size);
  std::string sample;
  char buf[kBlock];
  for (uint64_t b = 0; b < kBlocks; ++b) {
    const uint64_t offset = size <= kBlock ? 0 : (size - kBlock) * b / (kBlocks - 1);
    const ssize_t got = pread(fd, buf, kBlock, static_cast<off_t>(offset));
    if (got > 0) sample.append(buf, static_cast<size_t>(got));
    if (size <= kBlock) break;
  }
  close(fd);
  return std::to_string(size) + " bytes, sample " + hash_hex(sample.data(), sample.size());
}

void agree_on_options(Communicator& comm, const Signature& mine, const std::string& command) {
  const Agreement a = agree_across_ranks(comm, mine);
  if (a.agreed()) return;
  throw UsageError(detail::concat("the ranks were started with different options: --", a.field,
                                  " is ", a.value0, " on rank 0 but ", a.value, " on rank ", a.rank,
                                  "; every rank must get the same options "
                                  "(on an MPMD line 'mpirun -n 1 ctxpar ",
                                  command, " ... : -n 1 ctxpar ", command,
                                  " ...', repeat them all)"));
}

}  // namespace ctxpar::cli

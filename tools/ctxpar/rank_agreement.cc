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
namespace {

// name \x1f value \x1e ...: separators that no option value can hold (they come from argv
// words, file names and numbers; a value holding one would only make ranks disagree).
std::string serialize(const Signature& s) {
  std::string out;
  for (const auto& [name, value] : s) out += name + '\x1f' + value + '\x1e';
  return out;
}

Signature parse(const std::string& text) {
  Signature s;
  size_t at = 0;
  while (at < text.size() && text[at] != '\0') {
    const size_t sep = text.find('\x1f', at), end = text.find('\x1e', at);
    if (sep == std::string::npos || end == std::string::npos || sep > end) break;
    s.emplace_back(text.substr(at, sep - at), text.substr(sep + 1, end - sep - 1));
    at = end + 1;
  }
  return s;
}

std::string value_of(const Signature& s, const std::string& name) {
  for (const auto& [n, v] : s)
    if (n == name) return v.empty() ? "(not given)" : v;
  return "(unknown to this rank's ctxpar)";
}

}  // namespace

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

void agree_across_ranks(Communicator& comm, const Signature& mine, const std::string& command) {
  const std::string text = serialize(mine);
  const int P = comm.size();
  uint64_t length = text.size();
  std::vector<uint64_t> lengths(P);
  comm.allgather(&length, lengths.data(), sizeof length);
  uint64_t longest = 0;
  for (uint64_t l : lengths) longest = std::max(longest, l);
  std::string padded = text;
  padded.resize(longest, '\0');
  std::string all(longest * P, '\0');
  comm.allgather(padded.data(), all.data(), longest);
  std::vector<Signature> theirs(P);
  for (int r = 0; r < P; ++r) theirs[r] = parse(all.substr(r * longest, longest));
  // The first option, in rank 0's order, whose value differs on some rank (then options
  // that rank 0 does not know, from a different ctxpar build).
  Signature names = theirs[0];
  for (int r = 1; r < P; ++r)
    for (const auto& entry : theirs[r]) names.push_back(entry);
  for (const auto& [name, unused] : names)
    for (int r = 1; r < P; ++r) {
      const std::string a = value_of(theirs[0], name), b = value_of(theirs[r], name);
      if (a == b) continue;
      throw UsageError(detail::concat(
          "the ranks were started with different options: --", name, " is ", a, " on rank 0 but ",
          b, " on rank ", r, "; every rank must get the same options (on an MPMD line "
          "'mpirun -n 1 ctxpar ", command, " ... : -n 1 ctxpar ", command, " ...', repeat them all)"));
    }
}

}  // namespace ctxpar::cli

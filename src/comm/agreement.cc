#include "ctxpar/agreement.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "ctxpar/error.h"
#include "ctxpar/hash.h"

namespace ctxpar {
namespace {

constexpr int kMessageBytes = 440;  // a local error is cut to this (the verdict's fixed size)

struct Verdict {
  uint64_t signature_hash, signature_bytes;
  int64_t failed;
  char message[kMessageBytes];
};

// name \x1f value \x1e ...: separators that no field's value holds (names, numbers, file
// names, mask texts; a value holding one would only make ranks disagree).
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
  return "(unknown to this rank)";
}

// Every rank's signature (only called when the hashes differ: every rank knows that at once).
std::vector<Signature> gather_signatures(Communicator& comm, const std::string& text,
                                         const std::vector<Verdict>& verdicts) {
  const int p = comm.size();
  uint64_t longest = 0;
  for (const Verdict& v : verdicts) longest = std::max(longest, v.signature_bytes);
  std::string padded = text;
  padded.resize(longest, '\0');
  std::string all(longest * p, '\0');
  comm.allgather(padded.data(), all.data(), longest);
  std::vector<Signature> theirs(p);
  for (int r = 0; r < p; ++r) theirs[r] = parse(all.substr(r * longest, longest));
  return theirs;
}

}  // namespace

std::string Agreement::difference() const {
  if (field.empty()) return "";
  return detail::concat(field, " is ", value0, " on rank 0 but ", value, " on rank ", rank);
}

Agreement agree_across_ranks(Communicator& comm, const Signature& mine,
                             const std::string& local_error) {
  const std::string text = serialize(mine);
  Verdict v{};
  v.signature_hash = fnv1a64(text.data(), text.size());
  v.signature_bytes = text.size();
  v.failed = local_error.empty() ? 0 : 1;
  std::strncpy(v.message, local_error.c_str(), kMessageBytes - 1);
  const int p = comm.size();
  std::vector<Verdict> all(p);
  comm.allgather(&v, all.data(), sizeof(Verdict));
  Agreement a;
  a.ranks = p;
  for (int r = 0; r < p; ++r)
    if (all[r].failed) {
      if (a.failed_ranks.empty()) a.error = all[r].message;
      a.failed_ranks.push_back(r);
    }
  if (!a.failed_ranks.empty()) return a;
  bool same = true;
  for (int r = 1; r < p; ++r)
    same = same && all[r].signature_hash == all[0].signature_hash &&
           all[r].signature_bytes == all[0].signature_bytes;
  if (same) return a;
  const std::vector<Signature> theirs = gather_signatures(comm, text, all);
  Signature names = theirs[0];
  for (int r = 1; r < p; ++r) names.insert(names.end(), theirs[r].begin(), theirs[r].end());
  for (const auto& entry : names)
    for (int r = 1; r < p; ++r) {
      const std::string a0 = value_of(theirs[0], entry.first);
      const std::string ar = value_of(theirs[r], entry.first);
      if (a0 == ar) continue;
      a.field = entry.first;
      a.value0 = a0;
      a.value = ar;
      a.rank = r;
      return a;
    }
  // Equal values, different texts (a field listed twice): still not the same call.
  int r = 1;
  while (r + 1 < p && serialize(theirs[r]) == serialize(theirs[0])) ++r;
  a.field = "signature";
  a.value0 = serialize(theirs[0]);
  a.value = serialize(theirs[r]);
  a.rank = r;
  return a;
}

void require_agreement(Communicator& comm, const std::string& what, const Signature& mine,
                       const std::string& local_error) {
  const Agreement a = agree_across_ranks(comm, mine, local_error);
  if (!a.failed_ranks.empty()) {
    std::string ranks;
    for (int r : a.failed_ranks) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
    throw Error(detail::concat(what, ": invalid arguments on rank ", ranks, " (of ", a.ranks,
                               "): ", a.error));
  }
  if (!a.field.empty())
    throw Error(detail::concat(what,
                               ": the ranks were called with different arguments: ", a.difference(),
                               "; every rank of the communicator must pass the "
                               "same"));
}

}  // namespace ctxpar

#include "ctxpar/mask.h"

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "core/untrusted_json.h"
#include "ctxpar/error.h"
#include "ctxpar/hash.h"

namespace ctxpar {

std::string Mask::describe() const {
  std::string s;
  auto add = [&s](const std::string& part) { s += (s.empty() ? "" : "+") + part; };
  if (causal) add("causal");
  if (window_left >= 0 || window_right >= 0)
    add("window:" + std::to_string(window_left) + "," + std::to_string(window_right));
  if (documents) add("documents");
  if (sliced) {
    const std::span<const MaskSlice> list = slice_list();
    char hex[17];
    std::snprintf(hex, sizeof hex, "%016llx",
                  static_cast<unsigned long long>(fnv1a64(list.data(), list.size_bytes())));
    add("slices:" + std::to_string(list.size()) + "@" + hex);
  }
  return s.empty() ? "none" : s;
}

void Mask::set_slices(std::vector<MaskSlice> list) {
  for (size_t i = 0; i < list.size(); ++i) {
    const MaskSlice& s = list[i];
    CTXPAR_CHECK(0 <= s.q_lo && s.q_lo < s.q_hi && s.q_hi <= kMaxSlicePosition && 0 <= s.k_lo &&
                     s.k_lo < s.k_hi && s.k_hi <= kMaxSlicePosition,
                 "mask slice ", i, ": q [", s.q_lo, ", ", s.q_hi, ") k [", s.k_lo, ", ", s.k_hi,
                 ") is not two non-empty ranges 0 <= start < end <= 2^62");
    CTXPAR_CHECK(s.causal == 0 || s.causal == 1, "mask slice ", i, ": causal must be 0 or 1");
    list[i].unused = 0;  // hashed by describe(): no stray bits
  }
  CTXPAR_CHECK(list.size() <= size_t(INT32_MAX), "mask: ", list.size(), " slices, over 2^31 - 1");
  auto store = std::make_shared<const std::vector<MaskSlice>>(std::move(list));
  sliced = true;
  slice_count = static_cast<int32_t>(store->size());
  slices = store->data();
  slice_store_ = std::move(store);
}

std::vector<MaskSlice> prefix_tree_slices(int64_t prompt, const std::vector<int64_t>& responses) {
  std::vector<MaskSlice> out{{0, prompt, 0, prompt, 1}};
  int64_t at = prompt;
  for (int64_t r : responses) {
    out.push_back({at, at + r, 0, prompt, 0});
    out.push_back({at, at + r, at, at + r, 1});
    at += r;
  }
  return out;
}

std::vector<MaskSlice> parse_slices_json(const std::string& text, const std::string& subject) {
  const std::string fix =
      "write a JSON list of {\"q\": [start, end], \"k\": [start, end], \"type\": \"full\" or "
      "\"causal\"} (end exclusive)";
  const nlohmann::json j = io::parse_untrusted_json(text, subject, "slice list", fix);
  CTXPAR_CHECK(j.is_array() && !j.empty(), subject, ": expected a non-empty list of slices; ", fix);
  std::vector<MaskSlice> out;
  auto range = [&](const nlohmann::json& s, const char* key, size_t i, int64_t& lo, int64_t& hi) {
    const bool ok = s.contains(key) && s[key].is_array() && s[key].size() == 2 &&
                    s[key][0].is_number_integer() && s[key][1].is_number_integer();
    CTXPAR_CHECK(ok, subject, ": slice ", i, " needs \"", key,
                 "\": [start, end] with whole numbers; ", fix);
    lo = s[key][0].get<int64_t>(), hi = s[key][1].get<int64_t>();
  };
  for (size_t i = 0; i < j.size(); ++i) {
    const nlohmann::json& s = j[i];
    CTXPAR_CHECK(s.is_object(), subject, ": slice ", i, " is not an object; ", fix);
    for (auto it = s.begin(); it != s.end(); ++it)
      CTXPAR_CHECK(it.key() == "q" || it.key() == "k" || it.key() == "type", subject, ": slice ", i,
                   " has an unknown field \"", it.key(), "\"; ", fix);
    MaskSlice m;
    range(s, "q", i, m.q_lo, m.q_hi);
    range(s, "k", i, m.k_lo, m.k_hi);
    const std::string type =
        s.contains("type") && s["type"].is_string() ? s["type"].get<std::string>() : "";
    CTXPAR_CHECK(type == "full" || type == "causal", subject, ": slice ", i,
                 " needs \"type\": \"full\" or \"causal\"; ", fix);
    m.causal = type == "causal";
    out.push_back(m);
  }
  return out;
}

namespace {

constexpr const char* kGrammar =
    "the grammar is RULE or RULE+RULE+... with each rule at most once, RULE one of none, causal, "
    "window:L,R (whole numbers >= -1, -1 = unbounded), documents, documents:LEN,LEN,... "
    "(whole numbers >= 1), prefix-tree:PROMPT,R1,R2,... (whole numbers >= 1), slices:FILE.json "
    "or slices:[...] (a JSON list of {\"q\": [s, e], \"k\": [s, e], \"type\": "
    "\"full\"|\"causal\"}); no spaces, "
    "e.g. causal+window:256,0 or causal+documents:300,724 or prefix-tree:8192,2048,2048";

// A comma-separated list of whole numbers >= 1 (documents:..., prefix-tree:...).
std::vector<int64_t> parse_lengths(const std::string& list, const std::string& whole,
                                   const char* what);

std::string read_slice_file(const std::string& path, const std::string& whole) {
  std::ifstream in(path, std::ios::binary);
  CTXPAR_CHECK(in.good(), "mask '", whole, "': cannot open the slice file '", path,
               "'; give a readable JSON file, e.g. slices:mask.json");
  in.seekg(0, std::ios::end);
  const std::streamoff size = in.tellg();
  CTXPAR_CHECK(size >= 0 && uint64_t(size) <= io::kMaxJsonBytes, "mask '", whole,
               "': the slice file '", path, "' has ", size, " bytes, over the limit of ",
               io::kMaxJsonBytes);
  in.seekg(0);
  std::string text(static_cast<size_t>(size), '\0');
  in.read(text.data(), size);
  return text;
}

// A whole number of int64 in [lo, INT64_MAX]: digits with an optional leading '-', nothing else
// (strtoll alone took leading spaces and '+', and clamped an out-of-range number to INT64_MAX
// without a word: two such document lengths added up to 512).
int64_t parse_number(const std::string& text, int64_t lo, const std::string& whole,
                     const char* what) {
  const bool digits = !text.empty() &&
                      text.find_first_not_of("0123456789", text[0] == '-') == std::string::npos &&
                      text != "-";
  errno = 0;
  char* end = nullptr;
  const long long v = digits ? std::strtoll(text.c_str(), &end, 10) : 0;
  CTXPAR_CHECK(digits && errno != ERANGE && v >= lo, "mask '", whole, "': ", what, " '", text,
               "' is not a whole number in [", lo, ", ", INT64_MAX, "]; ", kGrammar);
  return v;
}

std::vector<int64_t> parse_lengths(const std::string& list, const std::string& whole,
                                   const char* what) {
  std::vector<int64_t> out;
  size_t from = 0;
  for (;;) {
    const size_t comma = list.find(',', from);
    out.push_back(parse_number(
        list.substr(from, comma == std::string::npos ? std::string::npos : comma - from), 1, whole,
        what));
    if (comma == std::string::npos) break;
    from = comma + 1;
  }
  return out;
}

// The sum of `lengths`, refused past kMaxSlicePosition (a prefix tree's slices hold it).
int64_t checked_total(const std::vector<int64_t>& lengths, const std::string& whole) {
  int64_t total = 0;
  for (int64_t l : lengths) {
    CTXPAR_CHECK(l <= kMaxSlicePosition - total, "mask '", whole,
                 "': the lengths add up to more "
                 "than 2^62 tokens");
    total += l;
  }
  return total;
}

Mask parse(const std::string& text, std::vector<int64_t>* lengths, int64_t* total = nullptr) {
  Mask m;
  bool seen_none = false, seen_window = false, seen_documents = false, seen_slices = false;
  auto once = [&](bool& seen, const std::string& part) {
    CTXPAR_CHECK(!seen, "mask '", text, "': the rule '", part, "' is given twice; ", kGrammar);
    seen = true;
  };
  size_t start = 0;
  while (start <= text.size()) {
    size_t plus = text.find('+', start);
    std::string part =
        text.substr(start, plus == std::string::npos ? std::string::npos : plus - start);
    if (part == "none") {
      once(seen_none, part);
    } else if (part == "causal") {
      once(m.causal, part);
    } else if (part == "documents" || part.rfind("documents:", 0) == 0) {
      once(seen_documents, "documents");
      m.documents = true;
      if (part.size() > 10 || part == "documents:") {
        const std::vector<int64_t> list = parse_lengths(part.substr(10), text, "document length");
        if (lengths) *lengths = list;
      }
    } else if (part.rfind("prefix-tree:", 0) == 0) {
      once(seen_slices, "prefix-tree / slices");
      const std::vector<int64_t> list = parse_lengths(part.substr(12), text, "prefix-tree length");
      CTXPAR_CHECK(list.size() >= 2, "mask '", text,
                   "': prefix-tree needs a prompt and at least one response, e.g. "
                   "prefix-tree:8192,2048,2048");
      const int64_t sum = checked_total(list, text);
      if (total) *total = sum;
      m.set_slices(prefix_tree_slices(list[0], {list.begin() + 1, list.end()}));
    } else if (part.rfind("slices:", 0) == 0) {
      once(seen_slices, "prefix-tree / slices");
      const std::string path = part.substr(7);  // a file, or the list itself ("slices:[...]")
      // "slices:N@HASH" is what describe() prints for a slice mask (reports, agreement): a
      // digest of the list, not the list. Said as such, not as a missing file named "3@4922...".
      const size_t at = path.find('@');
      CTXPAR_CHECK(!(at != std::string::npos && at > 0 && path.size() - at - 1 == 16 &&
                     path.find_first_not_of("0123456789") == at &&
                     path.find_first_not_of("0123456789abcdef", at + 1) == std::string::npos),
                   "mask '", text, "': '", part,
                   "' is the digest a report prints for a slice mask (count@FNV-1a hash), not the "
                   "slices; give the slices themselves: slices:FILE.json or slices:[{\"q\": "
                   "[s, e], \"k\": [s, e], \"type\": \"causal\"}, ...]");
      if (!path.empty() && path[0] == '[')
        m.set_slices(parse_slices_json(path, "mask '" + text + "'"));
      else
        m.set_slices(parse_slices_json(read_slice_file(path, text), "slice file '" + path + "'"));
    } else if (part.rfind("window:", 0) == 0) {
      once(seen_window, "window");
      std::string args = part.substr(7);
      size_t comma = args.find(',');
      CTXPAR_CHECK(comma != std::string::npos, "mask '", text,
                   "': window needs two bounds, e.g. window:128,0 (left, right); ", kGrammar);
      m.window_left = parse_number(args.substr(0, comma), -1, text, "window bound");
      m.window_right = parse_number(args.substr(comma + 1), -1, text, "window bound");
    } else {
      throw Error("unknown mask '" + part + "' in '" + text + "': " + kGrammar);
    }
    if (plus == std::string::npos) break;
    start = plus + 1;
  }
  return m;
}

}  // namespace

Mask parse_mask(const std::string& text) { return parse(text, nullptr); }

std::vector<int64_t> parse_document_lengths(const std::string& text) {
  std::vector<int64_t> lengths;
  parse(text, &lengths);
  return lengths;
}

int64_t mask_length_total(const std::string& text) {
  int64_t total = 0;
  parse(text, nullptr, &total);
  return total;
}

}  // namespace ctxpar

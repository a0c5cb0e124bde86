#include "ctxpar/mask.h"

#include <cerrno>
#include <cstdint>
#include <cstdlib>

#include "ctxpar/error.h"

namespace ctxpar {

std::string Mask::describe() const {
  std::string s;
  auto add = [&s](const std::string& part) { s += (s.empty() ? "" : "+") + part; };
  if (causal) add("causal");
  if (window_left >= 0 || window_right >= 0)
    add("window:" + std::to_string(window_left) + "," + std::to_string(window_right));
  if (documents) add("documents");
  return s.empty() ? "none" : s;
}

namespace {

constexpr const char* kGrammar =
    "the grammar is RULE or RULE+RULE+... with each rule at most once, RULE one of none, causal, "
    "window:L,R (whole numbers >= -1, -1 = unbounded), documents, documents:LEN,LEN,... "
    "(whole numbers >= 1); no spaces, e.g. causal+window:256,0 or causal+documents:300,724";

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

Mask parse(const std::string& text, std::vector<int64_t>* lengths) {
  Mask m;
  bool seen_none = false, seen_window = false, seen_documents = false;
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
        const std::string list = part.substr(10);
        size_t from = 0;
        for (;;) {
          const size_t comma = list.find(',', from);
          const int64_t len = parse_number(
              list.substr(from, comma == std::string::npos ? std::string::npos : comma - from), 1,
              text, "document length");
          if (lengths) lengths->push_back(len);
          if (comma == std::string::npos) break;
          from = comma + 1;
        }
      }
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

}  // namespace ctxpar

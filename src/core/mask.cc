#include "ctxpar/mask.h"

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
int64_t parse_bound(const std::string& text, const std::string& whole) {
  char* end = nullptr;
  long long v = std::strtoll(text.c_str(), &end, 10);
  CTXPAR_CHECK(!text.empty() && end && *end == '\0' && v >= -1, "mask '", whole,
               "': window bound '", text, "' is not a whole number >= -1 (-1 = unbounded)");
  return v;
}
}  // namespace

Mask parse_mask(const std::string& text) {
  Mask m;
  size_t start = 0;
  while (start <= text.size()) {
    size_t plus = text.find('+', start);
    std::string part = text.substr(start, plus == std::string::npos ? std::string::npos : plus - start);
    if (part == "none") {
    } else if (part == "causal") {
      m.causal = true;
    } else if (part.rfind("documents", 0) == 0) {
      // "documents" or "documents:len1,len2,..." (lengths are read by the caller).
      m.documents = true;
    } else if (part.rfind("window:", 0) == 0) {
      std::string args = part.substr(7);
      size_t comma = args.find(',');
      CTXPAR_CHECK(comma != std::string::npos, "mask '", text,
                   "': window needs two bounds, e.g. window:128,0 (left, right)");
      m.window_left = parse_bound(args.substr(0, comma), text);
      m.window_right = parse_bound(args.substr(comma + 1), text);
    } else {
      throw Error("unknown mask '" + part + "' in '" + text +
                  "': use none, causal, window:L,R, documents, or rules joined by '+' "
                  "(e.g. causal+window:256,0)");
    }
    if (plus == std::string::npos) break;
    start = plus + 1;
  }
  return m;
}

}  // namespace ctxpar

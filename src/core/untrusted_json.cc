#include "core/untrusted_json.h"

#include <algorithm>
#include <exception>

#include "ctxpar/error.h"

namespace ctxpar::io {

size_t json_nesting_depth(std::string_view text) {
  size_t depth = 0, deepest = 0;
  bool in_string = false, escaped = false;
  for (const char c : text) {
    if (in_string) {
      if (escaped)
        escaped = false;
      else if (c == '\\')
        escaped = true;
      else if (c == '"')
        in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      deepest = std::max(deepest, ++depth);
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
  return deepest;
}

nlohmann::json parse_untrusted_json(std::string_view text, const std::string& subject,
                                    const std::string& part, const std::string& fix) {
  CTXPAR_CHECK(text.size() <= kMaxJsonBytes, subject, " has a ", part, " of ", text.size(),
               " bytes, over the limit of ", kMaxJsonBytes, ": ", fix);
  const size_t depth = json_nesting_depth(text);
  CTXPAR_CHECK(depth <= kMaxJsonDepth, subject, " has a ", part, " nested ", depth,
               " levels deep, over the limit of ", kMaxJsonDepth, ": ", fix);
  try {
    return nlohmann::json::parse(text.begin(), text.end());
  } catch (const std::exception& e) {  // a parse error, or bad_alloc
    throw Error(subject + " has a malformed " + part + ": " + e.what());
  }
}

}  // namespace ctxpar::io

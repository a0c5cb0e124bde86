// JSON read from a file a user gave (a checkpoint's header): hostile input. Parsed only
// through parse_untrusted_json, which bounds its size and nesting before the parser sees it.
//
// Why the depth: nlohmann::json parses iteratively, but copying, dumping and comparing a value
// recurse once per level, so a 200 kB header of 100000 nested brackets overflowed the stack
// (SIGSEGV) in the first error message or checksum that touched it. A header ctxpar or the
// safetensors library writes nests 3 levels ({tensor: {shape: [...]}}); 64 leaves room for
// any metadata a person might add and keeps every recursion a few kB of stack.
#pragma once
#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

namespace ctxpar::io {

inline constexpr size_t kMaxJsonDepth = 64;
// The safetensors library refuses headers over 100 MB; so do we. A reader checks this before
// allocating the text (parse_untrusted_json checks it again).
inline constexpr uint64_t kMaxJsonBytes = 100'000'000;

// The deepest nesting of arrays and objects in `text`, counting [ { and ] } outside strings
// (a string's escaped quote does not end it): {} is 1, {"a": [1]} is 2. Exact for valid JSON;
// for invalid JSON a bound the parser then refuses anyway. One pass, no recursion, no
// allocation.
size_t json_nesting_depth(std::string_view text);

// Parses `text` as JSON. Throws ctxpar::Error, naming `subject` (e.g. "checkpoint ck.safetensors")
// and `part` (e.g. "header"):
//   "<subject> has a <part> of N bytes, over the limit of 100000000: <fix>"
//   "<subject> has a <part> nested N levels deep, over the limit of 64: <fix>"
//   "<subject> has a malformed <part>: <the parser's message>"
// The depth is checked before the parser runs: nothing is built, copied or printed first.
nlohmann::json parse_untrusted_json(std::string_view text, const std::string& subject,
                                    const std::string& part, const std::string& fix);

}  // namespace ctxpar::io

// libFuzzer target for the command-line parser (tools/ctxpar/options.cc) with the attention
// command's option table, and the attention job built from the options and validated
// (tools/ctxpar/cmd_attention.cc is compiled into this target to reach them). Built and run
// by scripts/fuzzers.sh.
//
// Input: the arguments after `ctxpar attention`, separated by '\n' (at most 32). Arguments that
// name a file outside the working folder (containing '/') are dropped: the target tests the
// parser, not the file system.
//
// Properties checked on every input:
//   - nothing crashes, overflows (UBSan) or throws anything but ctxpar::Error (UsageError is
//     one), whatever the arguments: numbers out of range, suffixes that overflow, NaN, repeated
//     or unknown options, a missing value;
//   - every number accessor returns a value inside the range it was asked for;
//   - parse_whole_number agrees with whole_number_in on every argument.
#include "cmd_attention.cc"  // NOLINT: the command's option table lives in its unnamed namespace
#include "fuzz_support.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace ctxpar;
  using namespace ctxpar::cli;
  const std::string input(reinterpret_cast<const char*>(data), size);
  if (input.find('\0') != std::string::npos) return 0;
  std::vector<std::string> args;  // after `ctxpar attention` (Options::parse takes no command)
  size_t start = 0;
  while (start <= input.size() && args.size() < 32) {
    size_t nl = input.find('\n', start);
    std::string a = input.substr(start, nl == std::string::npos ? std::string::npos : nl - start);
    if (a.find('/') == std::string::npos && a != "--help" && a != "-h") args.push_back(a);
    if (nl == std::string::npos) break;
    start = nl + 1;
  }
  for (size_t i = 0; i < args.size(); ++i) {
    int64_t v = 0;
    const bool ok = parse_whole_number(args[i], v);
    bool in = false;
    try {
      in = whole_number_in("x", args[i], INT64_MIN, INT64_MAX) == v;
    } catch (const Error& e) {
      fuzz::check_message("options_fuzz", e.what());
    }
    if (ok != in)
      fuzz::fail("options_fuzz", "parse_whole_number and whole_number_in disagree", args[i]);
  }
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  try {
    Options o = attention_options();
    if (!o.parse(static_cast<int>(args.size()), argv.data())) return 0;
    const int64_t seq = o.i64("seq", 1, kMaxTokens);
    if (seq < 1 || seq > kMaxTokens)
      fuzz::fail("options_fuzz", "--seq out of its range", o.str("seq"));
    const double lat = o.num("link-latency-us", 0, kMaxLinkLatencyUs);
    if (!(lat >= 0 && lat <= kMaxLinkLatencyUs))
      fuzz::fail("options_fuzz", "--link-latency-us out of its range", o.str("link-latency-us"));
    const double gbps = o.num_or_zero("link-gbps", kMinLinkGbps, kMaxLinkGbps);
    if (!(gbps == 0 || (gbps >= kMinLinkGbps && gbps <= kMaxLinkGbps)))
      fuzz::fail("options_fuzz", "--link-gbps out of its range", o.str("link-gbps"));
    const int t = threads_option(o);
    if (t < 1 || t > kMaxThreads)
      fuzz::fail("options_fuzz", "--threads out of its range", o.str("threads"));
    (void)o.list("mask");
    AttentionJob job = job_from(o);
    validate(job);
  } catch (const Error& e) {
    fuzz::check_message("options_fuzz", e.what());
  }
  return 0;
}

// libFuzzer target for the --mask parsers: ctxpar::parse_mask and parse_document_lengths
// (src/core/mask.cc), then the attention job's validation of them against --seq
// (tools/ctxpar/cmd_attention.cc, compiled into this target to reach its internal parsers).
// Built and run by scripts/fuzzers.sh.
//
// Input: the mask text, then optionally '\n' and the --seq value.
//
// Properties checked on every input:
//   - nothing crashes, overflows (UBSan: signed overflow in the length sum) or throws anything
//     but ctxpar::Error (UsageError is one);
//   - an accepted mask prints (Mask::describe) as a text that parses back to the same mask
//     (a slice list prints as a digest, slices:N@HASH, which is refused by name);
//   - every length the documents parser returns is >= 1;
//   - a job that validates has lengths that add up to exactly --seq.
#include "cmd_attention.cc"  // NOLINT: the command's parsers live in its unnamed namespace
#include "fuzz_support.h"

namespace {
bool same(const ctxpar::Mask& a, const ctxpar::Mask& b) {
  return a.causal == b.causal && a.window_left == b.window_left &&
         a.window_right == b.window_right && a.documents == b.documents;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace ctxpar;
  using namespace ctxpar::cli;
  std::string text(reinterpret_cast<const char*>(data), size);
  std::string seq = "1024";
  if (size_t nl = text.find('\n'); nl != std::string::npos) {
    seq = text.substr(nl + 1);
    text.resize(nl);
  }
  if (text.find('\0') != std::string::npos || seq.find('\0') != std::string::npos) return 0;
  Mask m;
  try {
    m = parse_mask(text);
  } catch (const Error& e) {
    fuzz::check_message("mask_fuzz", e.what());
    return 0;
  }
  // A slice mask prints its list as a digest (slices:N@HASH, last in describe()): that part
  // must be refused by name, the rest must parse back; the same text must give the same list.
  std::string printed = m.describe();
  if (m.sliced) {
    const size_t cut = printed.rfind("slices:");
    const std::string digest = printed.substr(cut);
    try {
      (void)parse_mask(digest);
      fuzz::fail("mask_fuzz", "a slice digest was accepted as a mask", digest);
    } catch (const Error& e) {
      if (std::string(e.what()).find("digest") == std::string::npos)
        fuzz::fail("mask_fuzz", "a slice digest was refused without saying it is one", e.what());
    }
    printed = cut == 0 ? "none" : printed.substr(0, cut - 1);
    if (parse_mask(text).describe() != m.describe())
      fuzz::fail("mask_fuzz", "the same slice mask text gave another slice list", text);
  }
  Mask again;
  try {
    again = parse_mask(printed);
  } catch (const Error& e) {
    fuzz::fail("mask_fuzz", "describe() of an accepted mask does not parse", printed);
  }
  if (!same(m, again)) fuzz::fail("mask_fuzz", "describe() round trip changed the mask", text);

  std::vector<int64_t> lengths;
  try {
    lengths = parse_document_lengths(text);
  } catch (const Error& e) {
    fuzz::check_message("mask_fuzz", e.what());
    return 0;
  }
  for (int64_t l : lengths)
    if (l < 1) fuzz::fail("mask_fuzz", "a document length < 1 was accepted", text);

  // The arguments after `ctxpar attention` (Options::parse takes no command name).
  std::string a1 = "--mask", a3 = "--seq", a5 = "--ranks", a6 = "2";
  std::vector<char*> argv = {a1.data(), text.data(), a3.data(), seq.data(),
                             a5.data(), a6.data(),   nullptr};
  try {
    Options o = attention_options();
    if (!o.parse(static_cast<int>(argv.size()) - 1, argv.data())) return 0;
    AttentionJob job = job_from(o);
    validate(job);
    if (job.mask.documents && job.documents.empty()) {
      int64_t sum = 0;
      for (int64_t l : job.document_lengths)
        if (__builtin_add_overflow(sum, l, &sum))
          fuzz::fail("mask_fuzz", "validated lengths whose sum overflows 64 bits", text);
      if (sum != job.seq)
        fuzz::fail("mask_fuzz", "validated lengths that do not add up to --seq", text);
    }
  } catch (const Error& e) {
    fuzz::check_message("mask_fuzz", e.what());
  }
  return 0;
}

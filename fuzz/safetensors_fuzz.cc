// libFuzzer target for the checkpoint reader (src/model/safetensors.cc, read_safetensors):
// the input is a whole .safetensors file. Built and run by scripts/fuzzers.sh.
//
// Properties checked on every input:
//   - read_safetensors never crashes, leaks, overflows its stack or reads out of bounds (ASan,
//     UBSan): it returns or throws ctxpar::Error (any other exception escapes and is a crash),
//     and the message names the file;
//   - an accepted file is consistent: every tensor holds exactly dtype x shape bytes.
#include <map>
#include <string>

#include "ctxpar/error.h"
#include "fuzz_support.h"
#include "model/training.h"

namespace {
uint64_t element_bytes(const std::string& dtype) {
  static const std::map<std::string, uint64_t> kBytes = {
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E5M2", 1}, {"F8_E4M3", 1},
      {"I16", 2},  {"U16", 2}, {"F16", 2}, {"BF16", 2},    {"I32", 4},
      {"U32", 4},  {"F32", 4}, {"I64", 8}, {"U64", 8},     {"F64", 8}};
  auto it = kBytes.find(dtype);
  return it == kBytes.end() ? 0 : it->second;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = fuzz::as_file(data, size);
  if (path.empty()) return 0;
  ctxpar::model::SafetensorsFile f;
  try {
    f = ctxpar::model::read_safetensors(path);
  } catch (const ctxpar::Error& e) {
    fuzz::check_message("safetensors_fuzz", e.what(), path);
    return 0;
  }
  for (const auto& [name, t] : f.tensors) {
    uint64_t bytes = element_bytes(t.dtype);
    for (int64_t d : t.shape) bytes *= static_cast<uint64_t>(d);
    if (bytes == 0 && t.dtype.empty()) fuzz::fail("safetensors_fuzz", "tensor without dtype", name);
    if (bytes != t.bytes.size())
      fuzz::fail("safetensors_fuzz", "accepted a tensor whose bytes are not dtype x shape", name);
  }
  return 0;
}

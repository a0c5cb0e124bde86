// libFuzzer target for the .npy parser (src/io/npy.cc). Built and run by scripts/fuzz.sh;
// see docs/cli-files.md, "Fuzzing the .npy reader".
//
// Properties checked on every input:
//   - parse_npy never crashes, leaks or reads out of bounds (ASan, UBSan): it returns a
//     Tensor or throws ctxpar::Error, and nothing else;
//   - its error message is one line that names the file;
//   - an accepted image survives our writer: parse(write(parse(x))) == parse(x) bit for bit;
//   - reading as bf16 accepts exactly the images that reading as fp32 accepts;
//   - read_npy (the file reader: header in two reads, data streamed, fp16 converted in
//     chunks) agrees with parse_npy on validity and on every byte. The file is an in-memory
//     memfd, so this costs no disk.
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "ctxpar/npy.h"

namespace {
[[noreturn]] void fuzz_fail(const char* what, const std::string& detail) {
  std::fprintf(stderr, "npy_fuzz: %s: %s\n", what, detail.c_str());
  std::abort();
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::span<const uint8_t> bytes(data, size);
  bool ok32 = false, ok16 = false;
  ctxpar::Tensor t;
  try {
    t = ctxpar::parse_npy(bytes, ctxpar::DType::f32, "fuzz.npy");
    ok32 = true;
  } catch (const ctxpar::Error& e) {
    std::string msg = e.what();
    if (msg.rfind("fuzz.npy: ", 0) != 0 || msg.find('\n') != std::string::npos)
      fuzz_fail("error message is not one line naming the file", msg);
  }
  try {
    ctxpar::parse_npy(bytes, ctxpar::DType::bf16, "fuzz.npy");
    ok16 = true;
  } catch (const ctxpar::Error&) {}
  if (ok32 != ok16) fuzz_fail("fp32 and bf16 reads disagree on validity", std::to_string(size));

  static const int fd = memfd_create("npy_fuzz", 0);
  if (fd >= 0 && ftruncate(fd, 0) == 0 && pwrite(fd, data, size, 0) == static_cast<ssize_t>(size)) {
    bool ok_file = false;
    ctxpar::Tensor f;
    try {
      f = ctxpar::read_npy("/proc/self/fd/" + std::to_string(fd));
      ok_file = true;
    } catch (const ctxpar::Error&) {}
    if (ok_file != ok32)
      fuzz_fail("read_npy and parse_npy disagree on validity", std::to_string(size));
    if (ok_file && (f.shape() != t.shape() || f.dtype() != t.dtype() ||
                    std::memcmp(f.data(), t.data(), t.bytes()) != 0))
      fuzz_fail("read_npy and parse_npy read different tensors", ctxpar::shape_str(t.shape()));
  }
  if (!ok32) return 0;
  std::vector<uint8_t> again = ctxpar::npy_bytes(t.view());
  ctxpar::Tensor u = ctxpar::parse_npy(again, ctxpar::DType::f32, "rewritten.npy");
  if (u.shape() != t.shape() || u.dtype() != t.dtype() ||
      std::memcmp(u.data(), t.data(), t.bytes()) != 0)
    fuzz_fail("round trip through our writer changed the tensor", ctxpar::shape_str(t.shape()));
  return 0;
}

// Whether the cuda device uses cuDNN (cudnn_use.h).
#include "cuda/cudnn_use.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>

#include "core/environment.h"
#include "ctxpar/error.h"

namespace ctxpar::cuda {

std::string cudnn_version_name(int64_t v) {
  if (v <= 0) return "unknown";
  // cuDNN 9 encodes major * 10000 + minor * 100 + patch; cuDNN 8 major * 1000 + minor * 100 + patch.
  const bool nine = v >= 10000;
  const int64_t major = nine ? v / 10000 : v / 1000, minor = nine ? v / 100 % 100 : v / 100 % 10;
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(v % 100);
}

std::string cudnn_version_refusal(int64_t v) {
  const std::string found = "libcudnn.so.9 reports cuDNN " + cudnn_version_name(v) +
                            " (cudnnGetVersion " + std::to_string(v) + ")";
  const std::string need = "ctxpar's fused calls need cuDNN 9 >= " + cudnn_version_name(kMinCudnn) +
                           "; install a newer cuDNN 9 (pip: nvidia-cudnn-cu13) and put its lib "
                           "folder on LD_LIBRARY_PATH, or set CTXPAR_CUDNN=off";
  if (v >= 100000) return found + ", not a cuDNN 9; " + need;
  if (v == 91000 || v == 91001)
    return found + ", which has known bf16 SDPA defects (cudnn-frontend refuses it); " + need;
  if (v < kMinCudnn) return found + "; " + need;
  return "";
}

CudnnMode parse_cudnn_mode(const char* value) {
  if (!value || !*value || std::strcmp(value, "auto") == 0) return CudnnMode::automatic;
  if (std::strcmp(value, "off") == 0) return CudnnMode::off;
  if (std::strcmp(value, "require") == 0) return CudnnMode::require;
  throw Error(std::string("CTXPAR_CUDNN='") + value +
              "': use off (every block on the fallback kernel), require (cuDNN or an error), "
              "or auto / unset (cuDNN where it loads)");
}

CudnnMode cudnn_mode() {
  const std::optional<std::string> mode = environment::cuda().cudnn;
  return parse_cudnn_mode(mode ? mode->c_str() : nullptr);
}

namespace {
std::mutex state_mu;
CudnnState state;
std::set<std::string> noted;
}  // namespace

void set_cudnn_state(const CudnnState& s) {
  std::lock_guard<std::mutex> l(state_mu);
  state = s;
  state.known = true;
}

CudnnState cudnn_state() {
  std::lock_guard<std::mutex> l(state_mu);
  return state;
}

bool note_once(const std::string& topic, const std::string& line) {
  {
    std::lock_guard<std::mutex> l(state_mu);
    if (!noted.insert(topic).second) return false;
  }
  std::fprintf(stderr, "ctxpar: %s\n", line.c_str());
  return true;
}

}  // namespace ctxpar::cuda

// Whether the cuda device uses cuDNN, and what a run says about it: the oldest cuDNN 9 the fused
// calls take (a rule tested on the CPU with the versions that matter), the CTXPAR_CUDNN switch,
// the one line printed when cuDNN is off, and the process's state for `--json` and
// `--version`. Plain C++ (no CUDA or cuDNN header): built into every ctxpar_device.
#pragma once
#include <cstdint>
#include <string>

namespace ctxpar::cuda {

// cudnnGetVersion() of the oldest cuDNN the fused calls accept: 9.10.2. cudnn-frontend 1.32
// (the calls' headers) refuses every bf16 SDPA on 9.10.0 / 9.10.1 (known defects), guards
// ragged GQA and bottom-right causal below 9.6 and left-bounded bands below 9.10.2, and
// nothing older was ever checked. Not "the headers this build used" (9.19 here): the GPU
// machine's torch 2.11 ships 9.17, and the frontend checks each graph against the library it
// runs on -- a graph it refuses there falls back to the exact kernel (cuda_cudnn.cc).
constexpr int64_t kMinCudnn = 91002;

// 91700 -> "9.17.0"; cuDNN 8's encoding too (8907 -> "8.9.7").
std::string cudnn_version_name(int64_t version);
// "" when a libcudnn.so.9 reporting `version` is used, else why not: the version found and the
// one needed, and what to install.
std::string cudnn_version_refusal(int64_t version);

// CTXPAR_CUDNN: unset, "" or "auto" (cuDNN where it loads, else the fallback kernel, said once),
// "off" (the fallback kernel for every block), "require" (no cuDNN, or a graph cuDNN refuses,
// is an error instead of a fallback).
enum class CudnnMode { automatic, off, require };
CudnnMode parse_cudnn_mode(const char* value);  // throws ctxpar::Error naming the choices
CudnnMode cudnn_mode();                         // of the environment

// The process's cuDNN, as the cuda device factory found it: the version in use, or why none.
struct CudnnState {
  bool known = false;      // no cuda device made yet
  std::string version;     // "9.26.0" when cuDNN is used
  std::string off_reason;  // else why not
};
void set_cudnn_state(const CudnnState& state);
CudnnState cudnn_state();

// Writes "ctxpar: <line>" to stderr the first time it is called with this `topic` in the
// process; true when it wrote. (Each rank thread makes its own device: one line, not P.)
bool note_once(const std::string& topic, const std::string& line);

}  // namespace ctxpar::cuda

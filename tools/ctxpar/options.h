// A small command-line parser shared by the subcommands: every option is declared with its
// default and help, so `--help` lists them all and an unknown option is an error that names
// the closest valid one.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "ctxpar/comm.h"
#include "ctxpar/device.h"
#include "ctxpar/error.h"
#include "ctxpar/kernel.h"
#include "ctxpar/limits.h"

namespace ctxpar::cli {

// A usage mistake: the command prints it with a pointer to --help and exits 2.
class UsageError : public Error {
 public:
  explicit UsageError(const std::string& what) : Error(what) {}
};

// Ranges the commands share (docs/cli.md, "Number ranges"). A value outside its range is a
// usage error naming the option and the range, never a wrapped or clamped number.
// The ranges the Python package shares are the library's (ctxpar/limits.h): kMaxTokens
// (--seq), kMaxHeads (--heads, --kv-heads), kMaxBatch (--batch), kMaxThreads (--threads),
// kMaxProcesses (MPI ranks, plan parallel degrees), kMinTimeout / kMaxTimeout (--timeout).
constexpr int kMaxRepeats = 1000000;                       // --repeats
constexpr double kMinLinkGbps = 1e-6, kMaxLinkGbps = 1e6;  // --link-gbps: 1 kB/s .. 1 PB/s
constexpr double kMaxLinkLatencyUs = 1e7;                  // --link-latency-us: 10 s
constexpr int64_t kMaxSeed = INT64_MAX;                    // --seed: [0, 2^63 - 1]
// Why --ranks stops at kMaxThreadsRanks (ctxpar/comm.h) on the threads transport.
inline constexpr const char* kThreadsRanksNote =
    "threads transport: every rank is a thread of this process and the per-pair state grows "
    "as ranks^2; for more ranks use mpirun -n P";

// "4096", "64K", "1M" -> the number. False when `text` is not a whole number or the number
// (after the K / M suffix) does not fit in int64.
bool parse_whole_number(const std::string& text, int64_t& value);
// v as %g ("1e+06"), for messages that state a range.
std::string number_text(double v);
// The same as a command's usage check: a whole number in [lo, hi], else a UsageError naming
// --option and the range (`note` is added after the range, e.g. why the limit is there).
int64_t whole_number_in(const std::string& option, const std::string& text, int64_t lo, int64_t hi,
                        const std::string& note = "");

class Options;
struct AttentionJob;
// add_job_shape()'s numbers into the job (--dtype is the command's to parse), and
// CTXPAR_ULYSSES_GROUPS (ulysses_groups_from_env).
void read_job_shape(const Options& o, AttentionJob& job);
// CTXPAR_ULYSSES_GROUPS for StrategyOptions::ulysses_groups: 0 when unset or empty, else an
// integer in [1, kMaxUlyssesGroups]; anything else is a UsageError naming the variable.
int ulysses_groups_from_env();
// --threads: the option when given (1 .. kMaxThreads), else the first number of
// OMP_NUM_THREADS when that is set (as OpenMP reads "4,2"), else 1. A bad OMP_NUM_THREADS is a
// usage error naming it.
int threads_option(const Options& o);
// --bf16-tier exact | fast (attention, bench cp, bench kernel, decode): KernelConfig::bf16_tier, one
// help text and one refusal for every command that takes it. Another value is a UsageError
// naming the option, the value and both choices.
extern const char* const kBf16TierHelp;
Bf16Tier bf16_tier_option(const Options& o);  // names: ctxpar::bf16_tier_name (kernel.h)
// The element type as the tables print it: "fp32", "bf16", or "bf16 (fast tier)".
const char* dtype_label(DType dtype, Bf16Tier tier);

class Options {
 public:
  Options(std::string command, std::string summary);
  // --name VALUE (default shown in --help; "" means no default).
  Options& add(const std::string& name, const std::string& default_value, const std::string& help);
  // --name (boolean, off by default).
  Options& flag(const std::string& name, const std::string& help);
  Options& example(const std::string& line);
  // --device cpu | sim | cuda and --sim-seed (attention, bench cp, train); read with device_of().
  Options& add_device();
  // The problem of one attention job, one declaration and one default each for `attention`
  // and `bench cp`: --batch --heads --kv-heads --head-dim --dtype --threads --seed --repeats
  // (read with read_job_shape(), attention_job.h).
  Options& add_job_shape();
  // Returns false when --help was given (help already printed to stdout).
  bool parse(int argc, char** argv);

  bool given(const std::string& name) const;
  bool on(const std::string& name) const;
  std::string str(const std::string& name) const;
  // Numbers, range-checked. Every number a command uses goes through one of these, so that
  // none is wrapped by a cast or an overflowing suffix (64K / 1M are accepted for whole
  // numbers) and none is NaN or infinite.
  int64_t i64(const std::string& name, int64_t lo, int64_t hi, const std::string& note = "") const;
  int i32(const std::string& name, int lo, int hi, const std::string& note = "") const;
  double num(const std::string& name, double lo, double hi, const std::string& note = "") const;
  // 0 (meaning "off") or a number in [lo, hi]: a value too small to model is refused, not
  // taken as "off".
  double num_or_zero(const std::string& name, double lo, double hi,
                     const std::string& note = "") const;
  // Any int64 (seeds) / any finite number: still refuse overflow, NaN and infinity.
  int64_t i64(const std::string& name) const;
  double num(const std::string& name) const;
  std::vector<std::string> list(const std::string& name) const;  // comma-separated
  std::vector<int64_t> list_i64(const std::string& name) const;
  std::string help() const;
  const std::string& command() const { return command_; }

 private:
  struct Spec {
    std::string default_value, help;
    bool is_flag = false;
  };
  const Spec& spec(const std::string& name) const;
  std::string command_, summary_;
  std::vector<std::string> order_;
  std::map<std::string, Spec> specs_;
  std::map<std::string, std::string> values_;
  std::vector<std::string> examples_;
};

// --device cuda: throws ctxpar::Error (exit 2) where no GPU is found (cudaGetDeviceCount's
// error and what was looked for) or the build has no CUDA; returns on a GPU. cuda_device.cc.
void check_cuda_device();
// --transport nccl | loopback (docs/cuda.md, "Transports"), checked before --device so that a
// refusal names the transport: either needs --device cuda and a GPU (the no-GPU line of
// --device cuda); nccl also mpirun or torchrun and a loadable NCCL. Throws ctxpar::Error
// (exit 2, one line); returns for every other transport. cuda_device.cc.
void check_gpu_transport(TransportKind transport, const std::string& device);
// `ctxpar --version`'s lines on the CUDA build (cuda_device.cc).
std::string cuda_version_lines();

// The device that --device / --sim-seed ask for (throws UsageError for an unknown one).
// Inline: dev/ programs compile options.cc without linking the device layer.
inline DeviceOptions device_of(const Options& o) {
  DeviceOptions d;
  try {
    d.kind = parse_device(o.str("device"));
  } catch (const Error& e) {
    throw UsageError(e.what());
  }
  if (d.kind == DeviceKind::cuda) check_cuda_device();
  d.sim_seed = static_cast<uint64_t>(o.i64("sim-seed"));
  return d;
}

}  // namespace ctxpar::cli

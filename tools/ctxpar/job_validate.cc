// Validation of an attention job: the same verdict on every rank, and a message that names
// what is wrong and what would work instead.
#include "ctxpar/gloo.h"
#include <algorithm>
#include <cstdint>
#include <numeric>

#include "job_internal.h"
#include "memory_estimate.h"

namespace ctxpar::cli {

using job::kv_heads_of;

std::vector<int32_t> dense_document_labels(const std::vector<int64_t>& ids) {
  std::vector<int64_t> distinct = ids;
  std::sort(distinct.begin(), distinct.end());
  distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
  CTXPAR_CHECK(distinct.size() <= static_cast<size_t>(INT32_MAX),
               "--documents: more than 2^31 distinct document ids");
  std::vector<int32_t> labels(ids.size());
  for (size_t i = 0; i < ids.size(); ++i)
    labels[i] = static_cast<int32_t>(std::lower_bound(distinct.begin(), distinct.end(), ids[i]) -
                                     distinct.begin());
  return labels;
}

namespace {

// --ulysses-degree, and the heads a Ulysses group splits (the library's rule, in flag names).
void validate_ulysses(const AttentionJob& job) {
  const int64_t P = job.ranks, Hq = job.heads;
  const bool uses_ulysses =
      job.strategy == StrategyKind::ulysses || job.strategy == StrategyKind::hybrid;
  CTXPAR_CHECK(job.ulysses_degree == 0 || job.strategy == StrategyKind::hybrid,
               "--ulysses-degree applies to --strategy hybrid only (ulysses uses all ", P,
               " ranks); drop it or use --strategy hybrid");
  CTXPAR_CHECK(
      job.exchange != Exchange::needed || has_needed_exchange(job.strategy),
      "--exchange needed applies to --strategy ring or allgather only (",
      strategy_name(job.strategy),
      " moves every token); drop it (or use --exchange auto), or use --strategy ring or allgather");
  if (uses_ulysses) {
    const int64_t u = job.ulysses_degree ? job.ulysses_degree : P;
    std::string divisors;
    for (int64_t d = 1; d <= P; ++d)
      if (P % d == 0) divisors += (divisors.empty() ? "" : ", ") + std::to_string(d);
    CTXPAR_CHECK(u >= 1 && P % u == 0, "--ulysses-degree ", u, " does not divide --ranks ", P,
                 "; use one of ", divisors);
    if (!ulysses_heads_rule(Hq, int(u)).empty()) {
      // The library's rule, in flag names; the largest Ulysses group it allows, for the hint.
      int64_t best = 1;
      for (int64_t d = 1; d <= P; ++d)
        if (P % d == 0 && ulysses_heads_rule(Hq, int(d)).empty()) best = d;
      throw Error(detail::concat(
          strategy_name(job.strategy), " splits heads across ", u, " ranks: needs --heads (", Hq,
          ") divisible by ", u, " (--kv-heads that do not split are replicated); use --heads ",
          (Hq + u - 1) / u * u, ", or --strategy ring, or --strategy hybrid --ulysses-degree ",
          best));
    }
  }
}

// The transport's needs: the device it runs, its launcher, a link only the threads transport
// simulates.
void validate_transport(const AttentionJob& job) {
  const int64_t P = job.ranks;
  // (nccl and loopback need --device cuda and a GPU: check_gpu_transport, cuda_device.cc.)
  const bool gpu_transport = transport_traits(job.transport).needs_gpu;
  CTXPAR_CHECK(gpu_transport || job.device.kind == DeviceKind::cpu ||
                   job.transport == TransportKind::threads,
               "--device ", device_name(job.device.kind),
               " runs on the threads transport only "
               "(its streams' worker threads use the communicator); use --device cpu under mpirun "
               "or torchrun");
  if (job.transport == TransportKind::gloo) {
    CTXPAR_CHECK(gloo_available(),
                 "--transport gloo: this ctxpar was built without the gloo "
                 "transport (reconfigure with -DCTXPAR_GLOO=ON; needs libgloo-dev)");
    CTXPAR_CHECK(launched_by_torchrun(),
                 "--transport gloo needs the job started by torchrun "
                 "(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), e.g. torchrun --nproc-per-node ",
                 P, " --no-python ctxpar attention ...; or use --transport threads");
    CTXPAR_CHECK(job.link.gbytes_per_second == 0 && job.link.latency_us == 0,
                 "--link-gbps / --link-latency-us simulate a link on the threads transport only");
  }
  if (job.transport == TransportKind::mpi) {
    CTXPAR_CHECK(launched_by_mpi(),
                 "--transport mpi needs the job started by mpirun, e.g. "
                 "mpirun -n ",
                 P, " ctxpar attention ...; or use --transport threads");
    CTXPAR_CHECK(job.link.gbytes_per_second == 0 && job.link.latency_us == 0,
                 "--link-gbps / --link-latency-us simulate a link on the threads transport only");
  }
  CTXPAR_CHECK(job.link.gbytes_per_second >= 0 && job.link.latency_us >= 0,
               "--link-gbps and --link-latency-us must be >= 0");
}

// Documents, positions: one per token of --seq.
void validate_tokens(const AttentionJob& job) {
  const int64_t T = job.seq;
  if (job.mask.documents) {
    CTXPAR_CHECK(!job.documents.empty() || !job.document_lengths.empty(),
                 "--mask documents needs the document lengths (--mask documents:512,512) or "
                 "--documents doc_ids.npy");
    if (job.documents.empty()) {
      int64_t sum = 0;
      for (int64_t len : job.document_lengths) {
        CTXPAR_CHECK(len >= 1, "--mask documents: every length must be >= 1, got ", len);
        // Checked: 2 x INT64_MAX + 514 wrapped to 512 and passed as --seq 512.
        CTXPAR_CHECK(!__builtin_add_overflow(sum, len, &sum),
                     "--mask documents: the lengths "
                     "add up to more than ",
                     INT64_MAX, " but --seq is ", T, "; they must cover the sequence exactly");
      }
      CTXPAR_CHECK(sum == T, "--mask documents: the lengths add up to ", sum, " but --seq is ", T,
                   "; they must cover the sequence exactly");
    }
  }
  CTXPAR_CHECK(job.documents.empty() || static_cast<int64_t>(job.documents.size()) == T,
               "--documents: ", job.documents.size(), " ids for ", T, " tokens");
  CTXPAR_CHECK(job.positions.empty() || static_cast<int64_t>(job.positions.size()) == T,
               "--positions: ", job.positions.size(), " positions for ", T, " tokens");
  for (size_t i = 0; i < job.positions.size(); ++i)
    CTXPAR_CHECK(job.positions[i] != kPaddingPosition, "--positions: token ", i, " has position ",
                 kPaddingPosition, " (INT64_MIN), which marks padding; use any other value");
}

// --q, --k, --v, --do: [B, T, H, D] each, the first three together.
void validate_inputs(const AttentionJob& job) {
  const int64_t T = job.seq, Hq = job.heads, Hkv = kv_heads_of(job);
  // Tensors given by a library caller, or files (shape from the header) by the command.
  struct Input {
    const char* name;
    const Tensor& tensor;
    const InputFile& file;
    int64_t heads;
  };
  const Input inputs[] = {{"--q", job.q, job.q_file, Hq},
                          {"--k", job.k, job.k_file, Hkv},
                          {"--v", job.v, job.v_file, Hkv},
                          {"--do", job.dout, job.dout_file, Hq}};
  for (const Input& in : inputs) {
    if (in.tensor.empty() && !in.file.given()) continue;
    const Shape want{job.batch, T, in.heads, job.head_dim};
    const Shape got = in.file.given() ? in.file.shape : in.tensor.shape();
    CTXPAR_CHECK(got == want, in.name, in.file.given() ? " " + in.file.path : "", ": shape ",
                 shape_str(got), ", expected ", shape_str(want),
                 " [B, T, H, D] to match the other inputs");
  }
  auto given = [](const Input& in) { return !in.tensor.empty() || in.file.given(); };
  CTXPAR_CHECK(given(inputs[0]) == given(inputs[1]) && given(inputs[1]) == given(inputs[2]),
               "--q, --k and --v come together");
}

}  // namespace

void validate(const AttentionJob& job) {
  const int64_t T = job.seq, P = job.ranks, Hq = job.heads, Hkv = kv_heads_of(job);
  CTXPAR_CHECK(job.batch >= 1, "--batch must be >= 1, got ", job.batch);
  CTXPAR_CHECK(T >= 1, "--seq must be >= 1, got ", T);
  CTXPAR_CHECK(Hq >= 1 && Hkv >= 1, "--heads and --kv-heads must be >= 1");
  CTXPAR_CHECK(Hq % Hkv == 0, "--heads ", Hq, " must be a multiple of --kv-heads ", Hkv,
               " (grouped-query attention); e.g. --kv-heads ", std::gcd(Hq, Hkv));
  CTXPAR_CHECK(job.head_dim >= 16 && job.head_dim <= 256, "--head-dim must be in [16, 256], got ",
               job.head_dim);
  CTXPAR_CHECK(job.dtype == DType::f32 || job.dtype == DType::bf16,
               "--dtype must be fp32 or bf16, got ", dtype_name(job.dtype));
  CTXPAR_CHECK(P >= 1, "--ranks must be >= 1, got ", P);
  CTXPAR_CHECK(job.threads >= 1, "--threads must be >= 1, got ", job.threads);
  CTXPAR_CHECK(job.repeats >= 1, "--repeats must be >= 1, got ", job.repeats);
  CTXPAR_CHECK(job.timeout_seconds >= 1e-3,
               "--timeout must be at least 0.001 seconds (waits are "
               "counted in milliseconds), got ",
               job.timeout_seconds);

  // Any --seq works: the layout pads it to its granule (docs/layouts.md, "Padding").
  validate_ulysses(job);
  validate_transport(job);
  validate_tokens(job);
  validate_inputs(job);
  check_memory(job);  // last: a shape that is wrong is named as such, not as too large
}

int progress_steps(const AttentionJob& job) {
  return 1 + job.repeats * (job.backward ? 2 : 1) + (job.check ? 1 : 0);
}

}  // namespace ctxpar::cli

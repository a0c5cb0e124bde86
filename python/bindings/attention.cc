// Attention entry points of the extension. Outputs are allocated by the Python side (in the
// caller's framework) and written here in place; inputs are read where they lie.
//   whole tensors  q, out, dout, dq  [B, T, Hq, D]; k, v, dk, dv [B, T, Hkv, D]; lse [B, Hq, T]
//                  P ranks run as threads: shard by the layout, run the strategy, unshard.
//   one rank       the same with T replaced by the local Tl = T / P, on a communicator.
// The GIL is released while ranks compute and communicate.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <mutex>
#include <numeric>
#include <string>

#include "communicator.h"
#include "ctxpar/device.h"
#include "ctxpar/layout.h"
#include "ctxpar/reference.h"
#include "ctxpar/strategy.h"
#include "ctxpar/threads_run.h"
#ifdef CTXPAR_PYTHON_TESTING
#include "testing.h"
#endif

namespace ctxpar::python {
namespace {

// Options shared by every entry point; names are parsed here so a bad name is a ValueError
// naming the argument before any rank starts.
struct Job {
  LayoutKind layout = LayoutKind::zigzag;
  StrategyOptions strategy;
  std::vector<int64_t> positions;  // T global positions (0..T-1 unless given)
  std::vector<int32_t> documents;  // T document ids, empty without the documents mask
};

template <typename Parse>
auto parse_named(const char* arg, const std::string& text, Parse&& parse) {
  try {
    return parse(text);
  } catch (const Error& e) {
    throw nb::value_error(detail::concat(arg, ": ", e.what()).c_str());
  }
}

Job make_job(int64_t tokens, const std::string& strategy, const std::string& layout,
             const std::string& mask, const std::optional<ReadArray>& positions,
             const std::optional<ReadArray>& documents, int ulysses_degree, int head_groups,
             int threads, float scale, const std::string& bf16_tier) {
  Job job;
  job.layout = parse_named("layout", layout, parse_layout);
  job.strategy.kind = parse_named("strategy", strategy, parse_strategy);
  job.strategy.mask = parse_named("mask", mask, parse_mask);
  job.strategy.ulysses_degree = ulysses_degree;
  job.strategy.head_groups = head_groups;
  if (threads < 1)
    throw nb::value_error(detail::concat("threads: must be >= 1, got ", threads).c_str());
  job.strategy.kernel.threads = threads;
  job.strategy.kernel.scale = scale;
  job.strategy.kernel.bf16_tier = bf16_tier_arg(bf16_tier);
  job.positions = int_vector<int64_t>(positions, "positions", tokens);
  if (job.positions.empty()) {
    job.positions.resize(tokens);
    std::iota(job.positions.begin(), job.positions.end(), int64_t{0});
  }
  job.documents = int_vector<int32_t>(documents, "document_ids", tokens);
  if (!job.documents.empty()) job.strategy.mask.documents = true;
  if (job.strategy.mask.documents && job.documents.empty())
    throw nb::value_error("mask: the documents rule needs document_ids= (one id per token)");
  return job;
}

// The positions and document ids of rank r's tokens.
struct RankTokens {
  std::vector<int64_t> positions;
  std::vector<int32_t> documents;
  Tokens view() const { return Tokens{positions, documents}; }
};
// Any T: the layout pads it to its granule (padding tokens get kPaddingPosition, invisible to
// the kernel in both directions; docs/layouts.md).
RankTokens rank_tokens(const Job& job, const Layout& layout, int rank) {
  RankTokens t;
  t.positions = layout.token_positions(rank, job.positions);
  if (!job.documents.empty()) t.documents = layout.shard(job.documents, rank);
  return t;
}

// The layout's granule as a rule of P (layout_granule).
const char* granule_rule(LayoutKind kind) {
  return kind == LayoutKind::zigzag     ? "2P"
         : kind == LayoutKind::balanced ? "CP (C its chunk)"
                                        : "P";
}

// Per-process shards hold Tl tokens each, so T = Tl * P must be a whole number of the layout's
// units: there is no room for padding in shards the caller already cut. The balanced layout
// balances the job's mask over its positions and document ids, as ctxpar.layout.positions(...,
// mask=, document_ids=) does for the caller's sharding.
// The balanced layout's solver is O((T / 64)^2): cp_attention calls it every layer, forward and
// backward, with the same batch, so the last layout is kept (one per thread: each thread rank
// of run_threads keeps its own) with what the solver read: document ids and positions compared
// whole, the mask by its description (a slice list by its hash).
Layout balanced_layout(const Job& job, int64_t tokens, int ranks) {
  struct Last {
    std::vector<int32_t> documents;
    std::vector<int64_t> positions;
    std::string mask;
    int64_t tokens = 0;
    int ranks = 0;
    std::optional<Layout> layout;
  };
  thread_local Last last;
  const std::string mask = job.strategy.mask.describe();
  if (!last.layout || last.tokens != tokens || last.ranks != ranks || last.mask != mask ||
      last.documents != job.documents || last.positions != job.positions)
    last = {job.documents,
            job.positions,
            mask,
            tokens,
            ranks,
            Layout(LayoutKind::balanced, tokens, ranks,
                   {job.strategy.mask, job.documents, job.positions})};
  return *last.layout;
}

Layout shard_layout(const Job& job, int64_t local_tokens, int ranks) {
  const int64_t tokens = local_tokens * ranks;
  const Layout layout = job.layout == LayoutKind::balanced ? balanced_layout(job, tokens, ranks)
                                                           : Layout(job.layout, tokens, ranks);
  if (layout.padding() != 0)
    throw nb::value_error(
        detail::concat(
            "q: ", local_tokens, " tokens per rank x ", ranks, " ranks cannot be cut by the ",
            layout_name(job.layout), " layout (it needs T % ", granule_rule(job.layout),
            " == 0, a multiple of ", layout_granule(job.layout, ranks, tokens),
            ": an even number of tokens per rank); pad the sequence, or use ctxpar.attention "
            "on whole tensors, which pads internally")
            .c_str());
  return layout;
}

struct JobArgs {
  std::string strategy, layout, mask;
  std::optional<ReadArray> positions, documents;
  int ulysses_degree, head_groups, threads;
  float scale;
  std::string bf16_tier;  // "exact" | "fast": KernelConfig::bf16_tier
  Job make(int64_t tokens) const {
    return make_job(tokens, strategy, layout, mask, positions, documents, ulysses_degree,
                    head_groups, threads, scale, bf16_tier);
  }
};

// Whole tensors on `ranks` thread ranks: the library's shard -> run -> unshard.
void run_whole(int ranks, const JobArgs& args, WholeAttention whole, bool forward) {
  if (ranks < 1) throw nb::value_error(detail::concat("ranks: must be >= 1, got ", ranks).c_str());
  const Job job = args.make(whole.q.dim(1));
  nb::gil_scoped_release release;
  whole.tokens = Tokens{job.positions, job.documents};
  run_whole_on_threads(ranks, job.layout, job.strategy, whole, forward, !forward);
}

void whole_forward(const ReadArray& q, const ReadArray& k, const ReadArray& v, const Array& out,
                   const Array& lse, int ranks, const JobArgs& args) {
  WholeAttention w;
  w.q = view_of(q, "q", 4), w.k = view_of(k, "k", 4), w.v = view_of(v, "v", 4);
  w.out = view_of(out, "out", 4), w.lse = view_of(lse, "lse", 3);
  run_whole(ranks, args, w, true);
}

void whole_backward(const ReadArray& q, const ReadArray& k, const ReadArray& v,
                    const ReadArray& out, const ReadArray& lse, const ReadArray& dout,
                    const Array& dq, const Array& dk, const Array& dv, int ranks,
                    const JobArgs& args) {
  WholeAttention w;
  w.q = view_of(q, "q", 4), w.k = view_of(k, "k", 4), w.v = view_of(v, "v", 4);
  w.out = view_of(out, "out", 4), w.lse = view_of(lse, "lse", 3);
  w.dout = view_of(dout, "dout", 4);
  w.dq = view_of(dq, "dq", 4), w.dk = view_of(dk, "dk", 4), w.dv = view_of(dv, "dv", 4);
  run_whole(ranks, args, w, false);
}

// The cuda device of CUDA tensors on GPU `cuda_index`: the built-in one, or in a test build
// the recording one a test turned on (testing.h).
DeviceOptions cuda_device_options(int cuda_index) {
  DeviceOptions d;
  d.kind = DeviceKind::cuda;
  d.cuda_index = cuda_index;
#ifdef CTXPAR_PYTHON_TESTING
  d.registry = testing::device_registry();
#endif
  return d;
}

// This rank's strategy: on the CPU device, or (cuda_index >= 0: every tensor is on that CUDA
// device) on a cuda device that uses the tensors' memory in place (Device::adopt; no staging,
// never freed by it). Order with the caller's stream: the Python side synchronizes torch's
// current stream before the call, and every forward / backward ends with the device's
// synchronize, so the results are complete when this returns.
std::unique_ptr<Strategy> rank_strategy(Communicator& comm, StrategyOptions options, int cuda_index,
                                        std::initializer_list<TensorView> tensors) {
  if (cuda_index < 0) return Strategy::create(comm, options);
  options.device = cuda_device_options(cuda_index);
  std::unique_ptr<Device> device = make_device(options.device, comm.rank());
  for (const TensorView& t : tensors) {
    if (t.empty()) continue;
    int64_t last = 0;
    for (int i = 0; i < t.ndim(); ++i) last += (t.dim(i) - 1) * t.stride(i);
    const bool adopted = device->adopt(t.data(), size_t(last + 1) * dtype_size(t.dtype()));
    CTXPAR_CHECK(adopted, "cuda_index ", cuda_index, ": make_device(cuda) made a ", device->name(),
                 " device");
  }
  return Strategy::create(comm, options, std::move(device));
}

// One rank's shard: T = Tl * comm.size(); positions / document_ids (if given) have T entries.
void local_forward(const PyCommunicator& c, const ReadArray& q, const ReadArray& k,
                   const ReadArray& v, const Array& out, const Array& lse, const JobArgs& args,
                   int cuda_index) {
  Communicator& comm = c.get();
  const TensorView qv = view_of(q, "q", 4, cuda_index), kv = view_of(k, "k", 4, cuda_index),
                   vv = view_of(v, "v", 4, cuda_index);
  const TensorView ov = view_of(out, "out", 4, cuda_index), lv = view_of(lse, "lse", 3, cuda_index);
  const Job job = args.make(qv.dim(1) * comm.size());
  nb::gil_scoped_release release;
  const Layout layout = shard_layout(job, qv.dim(1), comm.size());
  const RankTokens tokens = rank_tokens(job, layout, comm.rank());
  auto strategy = rank_strategy(comm, job.strategy, cuda_index, {qv, kv, vv, ov, lv});
  strategy->forward(qv, kv, vv, tokens.view(), ov, lv);
}

void local_backward(const PyCommunicator& c, const ReadArray& q, const ReadArray& k,
                    const ReadArray& v, const ReadArray& out, const ReadArray& lse,
                    const ReadArray& dout, const Array& dq, const Array& dk, const Array& dv,
                    const JobArgs& args, int cuda_index) {
  Communicator& comm = c.get();
  const int ci = cuda_index;
  const TensorView qv = view_of(q, "q", 4, ci), kv = view_of(k, "k", 4, ci),
                   vv = view_of(v, "v", 4, ci);
  const TensorView ov = view_of(out, "out", 4, ci), lv = view_of(lse, "lse", 3, ci),
                   gv = view_of(dout, "dout", 4, ci);
  const TensorView dqv = view_of(dq, "dq", 4, ci), dkv = view_of(dk, "dk", 4, ci),
                   dvv = view_of(dv, "dv", 4, ci);
  const Job job = args.make(qv.dim(1) * comm.size());
  nb::gil_scoped_release release;
  const Layout layout = shard_layout(job, qv.dim(1), comm.size());
  const RankTokens tokens = rank_tokens(job, layout, comm.rank());
  auto strategy = rank_strategy(comm, job.strategy, ci, {qv, kv, vv, ov, lv, gv, dqv, dkv, dvv});
  strategy->backward(qv, kv, vv, tokens.view(), ov, lv, gv, dqv, dkv, dvv);
}

// A std::vector<double> handed to NumPy without a copy (the capsule frees it).
nb::ndarray<nb::numpy, double> numpy_of(std::vector<double>&& values, const Shape& shape) {
  auto* owned = new std::vector<double>(std::move(values));
  nb::capsule owner(owned, [](void* p) noexcept { delete static_cast<std::vector<double>*>(p); });
  std::vector<size_t> dims(shape.begin(), shape.end());
  return nb::ndarray<nb::numpy, double>(owned->data(), dims.size(), dims.data(), owner);
}

// The project's fp64 reference (or the naive fp32 computation that sets the tolerance) of
// whole tensors, on one rank: (out [B, T, Hq, D], lse [B, Hq, T]) as float64 NumPy arrays.
nb::tuple reference_forward(const ReadArray& q, const ReadArray& k, const ReadArray& v,
                            const JobArgs& args, bool naive32) {
  const TensorView qv = view_of(q, "q", 4), kv = view_of(k, "k", 4), vv = view_of(v, "v", 4);
  const Job job = args.make(qv.dim(1));
  const Tokens tokens{job.positions, job.documents};
  reference::Result r;
  {
    nb::gil_scoped_release release;
    r = naive32 ? reference::attention_naive_f32(qv, tokens, kv, vv, tokens, job.strategy.mask, {},
                                                 job.strategy.kernel.scale)
                : reference::attention_f64(qv, tokens, kv, vv, tokens, job.strategy.mask, {},
                                           job.strategy.kernel.scale);
  }
  return nb::make_tuple(numpy_of(std::move(r.o), qv.shape()),
                        numpy_of(std::move(r.lse), {qv.dim(0), qv.dim(2), qv.dim(1)}));
}

// Rank `rank`'s global token indices, or (rank = -1) the permutation of all ranks' (rank 0's
// indices, then rank 1's, ...). `mask`, `documents`, `positions`: what the balanced layout
// balances (the other layouts ignore them).
std::vector<int64_t> layout_positions(const std::string& layout, int64_t tokens, int ranks,
                                      int rank, const std::string& mask,
                                      const std::optional<ReadArray>& documents,
                                      const std::optional<ReadArray>& positions) {
  const LayoutKind kind = parse_named("layout", layout, parse_layout);
  if (rank < -1 || rank >= ranks)
    throw nb::value_error(
        detail::concat("rank: ", rank, " is out of range [0, ", ranks, ")").c_str());
  Mask m = parse_named("mask", mask, parse_mask);
  const std::vector<int32_t> docs = int_vector<int32_t>(documents, "document_ids", tokens);
  const std::vector<int64_t> pos = int_vector<int64_t>(positions, "positions", tokens);
  if (!docs.empty()) m.documents = true;
  if (m.documents && docs.empty())
    throw nb::value_error("mask: the documents rule needs document_ids= (one id per token)");
  const Layout l(kind, tokens, ranks, {m, docs, pos});
  if (l.padding() != 0)
    throw nb::value_error(
        detail::concat(
            "tokens: ", tokens, " tokens cannot be cut into ", ranks, " equal shards by the ",
            layout, " layout (it needs T % ", granule_rule(kind), " == 0, a multiple of ",
            layout_granule(kind, ranks, tokens), "); pad the sequence to ", l.padded_tokens(),
            ", or use ctxpar.attention on whole tensors, which pads internally")
            .c_str());
  return rank < 0 ? l.permutation() : l.positions(rank);
}

// Why the cuda device cannot take this process's CUDA tensors ("" when it can): ctxpar.attention
// routes tensors whose DLPack device is kDLCUDA there (python/ctxpar/_arrays.py).
std::string cuda_unavailable() {
  const DeviceOptions options = cuda_device_options(-1);
#ifndef CTXPAR_PYTHON_CUDA
  if (!options.registry)
    return "this ctxpar was built without CUDA: nvcc was not found when the package was built "
           "(pyproject.toml's CTXPAR_CUDA=AUTO), or it was built with CTXPAR_CUDA=OFF "
           "(docs/cuda.md); move the tensors to the CPU with .cpu(), or rebuild it where nvcc "
           "is found (pip install . with the CUDA toolkit on PATH or CUDA_HOME set)";
#endif
  auto probe = [&options] {
    try {
      make_device(options, 0);
      return std::string();
    } catch (const Error& e) {
      return std::string(e.what());  // e.g. "no CUDA device found: ..." (src/cuda/runtime.h)
    }
  };
  if (options.registry) return probe();
  // The GPU's answer does not change within a process: asked once, not by a throwaway device
  // on every call with CUDA tensors (the GIL serialises the first call).
  static const std::string gpu = probe();
  return gpu;
}

}  // namespace

void bind_attention(nb::module_& m) {
  m.def("_cuda_unavailable", &cuda_unavailable);
#ifdef CTXPAR_PYTHON_TESTING
  testing::bind(m);
#endif
  // Keyword arguments shared by every entry point (the Python layer passes all of them).
  auto job_args = [](const std::string& strategy, const std::string& layout,
                     const std::string& mask, std::optional<ReadArray> positions,
                     std::optional<ReadArray> documents, int ulysses_degree, int head_groups,
                     int threads, float scale, const std::string& bf16_tier) {
    return JobArgs{strategy,
                   layout,
                   mask,
                   std::move(positions),
                   std::move(documents),
                   ulysses_degree,
                   head_groups,
                   threads,
                   scale,
                   bf16_tier};
  };
  nb::class_<JobArgs>(m, "_JobArgs")
      .def(nb::new_(job_args), nb::arg("strategy"), nb::arg("layout"), nb::arg("mask"),
           nb::arg("positions").none(), nb::arg("documents").none(), nb::arg("ulysses_degree"),
           nb::arg("head_groups"), nb::arg("threads"), nb::arg("scale"),
           nb::arg("bf16_tier") = "exact");
  m.def("_forward", &whole_forward);
  m.def("_backward", &whole_backward);
  m.def("_local_forward", &local_forward, nb::arg("comm"), nb::arg("q"), nb::arg("k"), nb::arg("v"),
        nb::arg("out"), nb::arg("lse"), nb::arg("args"), nb::arg("cuda_index") = -1);
  m.def("_local_backward", &local_backward, nb::arg("comm"), nb::arg("q"), nb::arg("k"),
        nb::arg("v"), nb::arg("out"), nb::arg("lse"), nb::arg("dout"), nb::arg("dq"), nb::arg("dk"),
        nb::arg("dv"), nb::arg("args"), nb::arg("cuda_index") = -1);
  // The address DLPack handed over: tests compare it with the caller's pointer (zero-copy).
  m.def("_data_pointer", [](const ReadArray& a) { return reinterpret_cast<uintptr_t>(a.data()); });
  m.def("_reference", &reference_forward, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("args"),
        nb::arg("naive32") = false);
  // The one home of the accuracy rule and of the layout's granule (ctxpar/reference.h,
  // ctxpar/layout.h), for ctxpar.testing and ctxpar.torch.
  m.def(
      "_accuracy_tolerance",
      [](double naive_error, double ref_max, double floor_rel) {
        return reference::accuracy_tolerance(naive_error, ref_max, floor_rel);
      },
      nb::arg("naive_error"), nb::arg("ref_max"), nb::arg("floor_rel") = reference::kAccuracyFloor);
  m.def(
      "_layout_granule",
      [](const std::string& layout, int ranks, int64_t tokens) {
        return layout_granule(parse_layout(layout), ranks, tokens);
      },
      nb::arg("layout"), nb::arg("ranks"), nb::arg("tokens") = 0);
  m.def("_layout_positions", &layout_positions, nb::arg("layout"), nb::arg("tokens"),
        nb::arg("ranks"), nb::arg("rank"), nb::arg("mask") = "none",
        nb::arg("documents").none() = nb::none(), nb::arg("positions").none() = nb::none());
}

}  // namespace ctxpar::python

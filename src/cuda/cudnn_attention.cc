// cuDNN's fused attention for the fused calls of a block pair (cudnn_attention.h). The one
// translation unit that includes cudnn-frontend, with NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING:
// libcudnn.so.9 (and the frontend's libcudart / libnvrtc) are opened at run time, so a binary
// built here starts on machines without cuDNN and create() says what is missing.
//
// Graphs are built once per key -- storage type, batch, heads, head dim, scale, the call's rows
// and keys, its mask form (sdpa_mask_of), forward or backward, every tensor's strides -- and
// cached (llm.c's cudnn_att.cpp habit); a call executes its graph with a variant pack of
// device pointers offset to the call's rows and keys (q + q_begin * t_stride, ...).
// Built without the frontend headers (CTXPAR_HAVE_CUDNN_FRONTEND unset), create() says so.
#include "cuda/cudnn_attention.h"

#include "ctxpar/error.h"

#if !CTXPAR_HAVE_CUDNN_FRONTEND

namespace ctxpar::cuda {
namespace {
std::unique_ptr<CudnnAttention> unavailable(std::string* why) {
  if (why)
    *why =
        "this build has no cuDNN execution path: the cudnn-frontend headers were not found at "
        "configure time (run scripts/cudnn_frontend.sh, then re-run cmake)";
  return nullptr;
}
}  // namespace
std::unique_ptr<CudnnAttention> CudnnAttention::create(std::string* why) {
  return unavailable(why);
}
int64_t CudnnAttention::loaded_version() { return 0; }
std::unique_ptr<CudnnAttention> CudnnAttention::create_deviceless(const std::string&,
                                                                  std::string* why) {
  return unavailable(why);
}
}  // namespace ctxpar::cuda

#else

#include <cudnn_frontend.h>
#include <dlfcn.h>

#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <type_traits>
#include <unordered_map>
#include <mutex>
#include <sstream>
#include <utility>
#include <vector>

#include "cuda/cudnn_use.h"
#include "cuda/kernels.h"
#include "cuda/sdpa_mask.h"

namespace cudnn_frontend {
void* cudnn_dlhandle = nullptr;  // the frontend's dlsym()s look here (cudnn_frontend_shim.h)
}

namespace ctxpar::cuda {
namespace {

namespace fe = cudnn_frontend;
using TensorPtr = std::shared_ptr<fe::graph::Tensor_attributes>;

// Tensor uids of the variant pack.
enum Uid : int64_t { kQ = 1, kK, kV, kO, kStats, kDO, kDQ, kDK, kDV };

// How a graph writes O (forward) or dQ, dK, dV (backward), tried in this order; the first the
// graph build accepts is cached. fp32 outputs: partials never rounded to bf16 before the device
// merges them. bf16 outputs: cuDNN writes them dense into scratch after its workspace, and a
// cast kernel (kernels.h) copies them into the caller's fp32 tensors -- the bf16 tier of
// docs/cuda.md. (In the device-less check cuDNN 9.19 takes fp32 O for masked forwards, fp32 O
// without a mask only through the composite implementation, and fp32 dQ/dK/dV for MHA only.)
struct Variant {
  bool fp32 = true;
  bool composite = false;  // forward: AttentionImplementation_t::COMPOSITE instead of AUTO
  const char* name = "";
};
constexpr Variant kForwardVariants[] = {{true, false, "fp32 outputs"},
                                        {true, true, "fp32 outputs, composite implementation"},
                                        {false, false, "bf16 outputs cast to fp32"}};
constexpr Variant kBackwardVariants[] = {{true, false, "fp32 outputs"},
                                         {false, false, "bf16 outputs cast to fp32"}};
constexpr size_t kAlign = 256;
size_t align_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// Opens libcudnn.so.9 once for the process; "" when it is usable, else why not. Its version
// must meet the floor of the fused calls (cudnn_use.h), not the headers' version: each graph
// is checked by the frontend against the library found, and a refused one falls back.
int64_t loaded = 0;  // cudnnGetVersion() of the library in use
std::string load_cudnn() {
  static std::once_flag once;
  static std::string failure;
  std::call_once(once, [] {
    dlerror();
    void* h = dlopen("libcudnn.so.9", RTLD_NOW | RTLD_LOCAL);
    if (!h) {
      const char* e = dlerror();
      failure = std::string("libcudnn.so.9 cannot be loaded (") + (e ? e : "unknown error") +
                "); install cuDNN 9 (>= " + cudnn_version_name(kMinCudnn) +
                ") and put its lib folder on LD_LIBRARY_PATH";
      return;
    }
    auto version = reinterpret_cast<size_t (*)()>(dlsym(h, "cudnnGetVersion"));
    if (!version) {
      failure = "libcudnn.so.9 has no cudnnGetVersion: not a cuDNN 9 library";
      return;
    }
    failure = cudnn_version_refusal(int64_t(version()));
    if (!failure.empty()) return;
    loaded = int64_t(version());
    fe::cudnn_dlhandle = h;
  });
  return failure;
}

int64_t elem_bytes(DType t) { return int64_t(dtype_size(t)); }

const char* ptr_at(const void* base, int64_t elements, DType t) {
  return static_cast<const char*>(base) + elements * elem_bytes(t);
}

// Our [B, T, H, D] seen as cuDNN's [B, H, T, D] through strides (no transpose).
TensorPtr bhtd(fe::graph::Graph& g, const char* name, int64_t uid, int64_t b, int64_t h, int64_t t,
               int64_t d, const SdpaTensor& s) {
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_name(name)
                      .set_uid(uid)
                      .set_dim({b, h, t, d})
                      .set_stride({s.b_stride, s.h_stride, s.t_stride, 1}));
}
// An output: fp32 with the caller's strides, or bf16 dense (the scratch of the bf16 tier).
void as_output(const TensorPtr& out, int64_t uid, int64_t b, int64_t h, int64_t t, int64_t d,
               const SdpaTensor& s, bool fp32) {
  const SdpaTensor w = fp32 ? s : SdpaTensor{nullptr, t * h * d, h * d, d};
  out->set_output(true)
      .set_uid(uid)
      .set_data_type(fp32 ? fe::DataType_t::FLOAT : fe::DataType_t::BFLOAT16)
      .set_dim({b, h, t, d})
      .set_stride({w.b_stride, w.h_stride, w.t_stride, 1});
}
bool is_dense(const SdpaTensor& s, int64_t t, int64_t h, int64_t d) {
  return s.h_stride == d && s.t_stride == h * d && s.b_stride == t * h * d;
}
fe::graph::Tensor_attributes stats_attributes(int64_t b, int64_t h, int64_t t, const SdpaRows& r) {
  return fe::graph::Tensor_attributes()
      .set_name("stats")
      .set_uid(kStats)
      .set_dim({b, h, t, 1})
      .set_stride({r.b_stride, r.h_stride, r.t_stride, 1})
      .set_data_type(fe::DataType_t::FLOAT);
}

template <class Attributes>
void apply_mask(Attributes& a, const SdpaMask& m) {
  using A = SdpaMask::Alignment;
  if (m.alignment == A::none) return;
  a.set_diagonal_alignment(m.alignment == A::top_left ? fe::DiagonalAlignment_t::TOP_LEFT
                                                      : fe::DiagonalAlignment_t::BOTTOM_RIGHT);
  if (m.has_right) a.set_diagonal_band_right_bound(int(m.right));
  if (m.has_left) a.set_diagonal_band_left_bound(int(m.left));
}

std::string strides_text(const char* name, const SdpaTensor& s) {
  return std::string(" ") + name + "(" + std::to_string(s.b_stride) + "," +
         std::to_string(s.t_stride) + "," + std::to_string(s.h_stride) + ")";
}
std::string strides_text(const char* name, const SdpaRows& s) {
  return std::string(" ") + name + "(" + std::to_string(s.b_stride) + "," +
         std::to_string(s.h_stride) + "," + std::to_string(s.t_stride) + ")";
}

// The cache key, readable: it is also the graph's shape in error messages.
std::string key_of(const SdpaShape& s, const fused::Call& c, bool backward) {
  uint32_t scale_bits;
  std::memcpy(&scale_bits, &s.scale, sizeof scale_bits);
  std::ostringstream k;
  k << (backward ? "backward " : "forward ") << dtype_name(s.dtype) << " B=" << s.batch
    << " Hq=" << s.hq << " Hkv=" << s.hkv << " D=" << s.d << " rows=" << c.rows()
    << " keys=" << c.keys() << " mask=" << sdpa_mask_of(c).describe() << " scale=" << s.scale
    << " (0x" << std::hex << scale_bits << std::dec << ") strides(b,t,h):";
  return k.str();
}
std::string key_of(const SdpaShape& s, const fused::Call& c, const SdpaForward& t) {
  return key_of(s, c, false) + strides_text("q", t.q) + strides_text("k", t.k) +
         strides_text("v", t.v) + strides_text("o", t.o) + strides_text("lse(b,h,t)", t.lse);
}
std::string key_of(const SdpaShape& s, const fused::Call& c, const SdpaBackward& t) {
  return key_of(s, c, true) + strides_text("q", t.q) + strides_text("k", t.k) +
         strides_text("v", t.v) + strides_text("o", t.out) + strides_text("do", t.dout) +
         strides_text("lse(b,h,t)", t.lse) + strides_text("dq", t.dq) + strides_text("dk", t.dk) +
         strides_text("dv", t.dv);
}

// Dense call-local tensors: what workspace_bytes() builds when it is not told the strides.
SdpaTensor dense(int64_t rows, int64_t heads, int64_t d) {
  return {nullptr, rows * heads * d, heads * d, d};
}
SdpaRows dense_rows(int64_t rows, int64_t heads) { return {nullptr, heads * rows, rows, 1}; }
SdpaForward dense_forward(const SdpaShape& s, const fused::Call& c) {
  SdpaForward f;
  f.q = f.o = dense(c.rows(), s.hq, s.d);
  f.k = f.v = dense(c.keys(), s.hkv, s.d);
  f.lse = dense_rows(c.rows(), s.hq);
  return f;
}
SdpaBackward dense_backward(const SdpaShape& s, const fused::Call& c) {
  SdpaBackward b;
  b.q = b.out = b.dout = b.dq = dense(c.rows(), s.hq, s.d);
  b.k = b.v = b.dk = b.dv = dense(c.keys(), s.hkv, s.d);
  b.lse = dense_rows(c.rows(), s.hq);
  return b;
}

// The messages of a plan build that failed only at the module load (device-less mode: the
// stub libcuda has no GPU behind it, cuLibraryLoadData returns error 34): the number of such
// plans, 0 when anything else failed.
size_t count_of(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}
size_t plans_stopped_at_module_load(const std::string& message) {
  const size_t plans = count_of(message, "Plan at index");
  return plans > 0 && count_of(message, "cuLibraryLoadData returned error") == plans ? plans : 0;
}

struct Entry {
  std::unique_ptr<fe::graph::Graph> graph;
  SdpaPrepared info;
  size_t cudnn_workspace = 0;  // the bf16 tier's scratch starts at align_up(cudnn_workspace)
};

// Scratch after cuDNN's workspace, per uid: the bf16 tier's dense [B, t, H, D] bf16 outputs,
// and the backward's packed [B, Hq, rows] copy of the rows' LSE (cuDNN < 9.26 takes only a
// packed Stats input in sdpa_backward; ours is the whole block's [B, Hq, Tq]).
struct Scratch {
  size_t offset;
  int64_t t, h;
};
std::map<int64_t, Scratch> scratch_of(const SdpaShape& s, const fused::Call& c, bool backward,
                                      bool bf16_outputs, size_t cudnn_workspace, size_t* end) {
  std::map<int64_t, Scratch> out;
  size_t at = align_up(cudnn_workspace);
  auto add = [&](int64_t uid, int64_t t, int64_t h, size_t elem) {
    out[uid] = {at, t, h};
    at += align_up(size_t(s.batch * t * h) * elem);
  };
  if (backward) add(kStats, c.rows(), s.hq, sizeof(float));
  if (bf16_outputs && !backward) add(kO, c.rows(), s.hq, s.d * sizeof(uint16_t));
  if (bf16_outputs && backward) {
    add(kDQ, c.rows(), s.hq, s.d * sizeof(uint16_t));
    add(kDK, c.keys(), s.hkv, s.d * sizeof(uint16_t));
    add(kDV, c.keys(), s.hkv, s.d * sizeof(uint16_t));
  }
  *end = out.empty() ? cudnn_workspace : at;
  return out;
}

class Cudnn final : public CudnnAttention {
 public:
  Cudnn(cudnnHandle_t handle, std::shared_ptr<fe::DeviceProperties> props)
      : handle_(handle), props_(std::move(props)) {}
  ~Cudnn() override {
    cache_.clear();
    if (handle_) fe::detail::destroy_handle(handle_);
  }

  bool supports(const SdpaShape& s) const override {
    return s.dtype == DType::bf16 && s.d > 0 && s.d % 8 == 0 && s.d <= 256 && s.hkv > 0 &&
           s.hq > 0 && s.hq % s.hkv == 0 && s.batch > 0;
  }

  size_t workspace_bytes(const SdpaShape& s, const fused::Call& c, bool backward) override {
    std::lock_guard<std::mutex> lock(mutex_);
    const std::string wkey = key_of(s, c, backward);
    auto it = workspace_.find(wkey);
    if (it != workspace_.end()) return it->second;
    const Entry& e =
        backward ? entry(s, c, dense_backward(s, c)) : entry(s, c, dense_forward(s, c));
    if (!e.info.executable)
      fail(c, backward, e.info.key,
           "workspace_bytes(): the graph was built device-less and has "
           "no plan to size");
    return workspace_[wkey] = e.info.workspace_bytes;
  }

  SdpaPrepared prepare(const SdpaShape& s, const fused::Call& c, const SdpaForward& t) override {
    std::lock_guard<std::mutex> lock(mutex_);
    return entry(s, c, t).info;
  }
  SdpaPrepared prepare(const SdpaShape& s, const fused::Call& c, const SdpaBackward& t) override {
    std::lock_guard<std::mutex> lock(mutex_);
    return entry(s, c, t).info;
  }
  size_t graphs_built() const override {
    std::lock_guard<std::mutex> lock(mutex_);
    return cache_.size();
  }

  void forward(const SdpaShape& s, const fused::Call& c, const SdpaForward& t, void* workspace,
               cudaStream_t stream) override {
    std::lock_guard<std::mutex> lock(mutex_);
    const Entry& e = entry(s, c, t);
    std::unordered_map<int64_t, void*> pack = {
        {kQ, const_cast<char*>(ptr_at(t.q.data, c.q_begin * t.q.t_stride, s.dtype))},
        {kK, const_cast<char*>(ptr_at(t.k.data, c.k_begin * t.k.t_stride, s.dtype))},
        {kV, const_cast<char*>(ptr_at(t.v.data, c.k_begin * t.v.t_stride, s.dtype))},
        {kO, t.o.data},
        {kStats, t.lse.data}};
    const std::pair<int64_t, SdpaTensor> outputs[] = {{kO, t.o}};
    execute(e, s, c, false, pack, outputs, nullptr, workspace, stream);
  }

  void backward(const SdpaShape& s, const fused::Call& c, const SdpaBackward& t, void* workspace,
                cudaStream_t stream) override {
    std::lock_guard<std::mutex> lock(mutex_);
    const Entry& e = entry(s, c, t);
    auto rows = [&](const SdpaTensor& x) {
      return const_cast<char*>(ptr_at(x.data, c.q_begin * x.t_stride, s.dtype));
    };
    auto keys = [&](const SdpaTensor& x) {
      return const_cast<char*>(ptr_at(x.data, c.k_begin * x.t_stride, s.dtype));
    };
    std::unordered_map<int64_t, void*> pack = {
        {kQ, rows(t.q)},     {kK, keys(t.k)},  {kV, keys(t.v)},  {kO, rows(t.out)},
        {kDO, rows(t.dout)}, {kDQ, t.dq.data}, {kDK, t.dk.data}, {kDV, t.dv.data}};
    const std::pair<int64_t, SdpaTensor> outputs[] = {{kDQ, t.dq}, {kDK, t.dk}, {kDV, t.dv}};
    execute(e, s, c, true, pack, outputs, &t.lse, workspace, stream);
  }

 private:
  static std::string about(const fused::Call& c, bool backward, const std::string& key,
                           const std::string& what) {
    return "cuDNN SDPA " + std::string(backward ? "backward" : "forward") + " of the call " +
           c.describe() + " (rows [" + std::to_string(c.q_begin) + ", " + std::to_string(c.q_end) +
           "), keys [" + std::to_string(c.k_begin) + ", " + std::to_string(c.k_end) +
           ")): " + what + "; graph: " + key;
  }
  [[noreturn]] void fail(const fused::Call& c, bool backward, const std::string& key,
                         const std::string& what) const {
    throw Error(about(c, backward, key, what));
  }

  template <class Tensors>
  const Entry& entry(const SdpaShape& s, const fused::Call& c, const Tensors& t) {
    constexpr bool backward = std::is_same_v<Tensors, SdpaBackward>;
    const std::string key = key_of(s, c, t);
    auto it = cache_.find(key);
    if (it != cache_.end()) return *it->second;
    // A refused graph is refused again at once: its build (NVRTC) costs seconds.
    if (auto r = refused_.find(key); r != refused_.end()) throw CudnnRefused(r->second);
    if (!supports(s))
      fail(c, backward, key,
           "shape not supported by the cuDNN path (bf16 storage, D a multiple "
           "of 8 and <= 256, Hq a multiple of Hkv): use the fallback kernel");
    if (c.rows() <= 0 || c.keys() <= 0) fail(c, backward, key, "empty call");
    std::string refusals;
    for (const Variant& variant :
         backward
             ? std::vector<Variant>(std::begin(kBackwardVariants), std::end(kBackwardVariants))
             : std::vector<Variant>(std::begin(kForwardVariants), std::end(kForwardVariants))) {
      auto e = std::make_unique<Entry>();
      e->graph = std::make_unique<fe::graph::Graph>();
      std::string refused;
      if (!try_build(*e, s, c, t, variant, key, &refused)) {
        refusals += std::string(refusals.empty() ? "" : "; ") + variant.name + ": " + refused;
        continue;
      }
      e->info.graph_id = cache_.size();
      e->info.key = key;
      e->info.fp32_outputs = variant.fp32;
      if (e->info.executable)
        scratch_of(s, c, backward, !variant.fp32, e->cudnn_workspace, &e->info.workspace_bytes);
      return *cache_.emplace(key, std::move(e)).first->second;
    }
    const std::string why =
        about(c, backward, key, "cuDNN refused every form of the graph: " + refusals);
    refused_.emplace(key, why);
    throw CudnnRefused(why);
  }

  // Builds one variant of a graph; false (with why) when cuDNN refuses it (validation,
  // heuristics, support check, or a plan build that fails for another reason than the
  // device-less module load), an Error for anything else.
  template <class Tensors>
  bool try_build(Entry& e, const SdpaShape& s, const fused::Call& c, const Tensors& t,
                 const Variant& variant, const std::string& key, std::string* why) {
    constexpr bool backward = std::is_same_v<Tensors, SdpaBackward>;
    fe::graph::Graph& g = *e.graph;
    try {
      build(g, s, c, t, variant);
    } catch (const std::exception& x) {  // the frontend throws on a missing symbol
      fail(c, backward, key, std::string("cudnn-frontend threw: ") + x.what());
    }
    const std::pair<const char*, std::function<fe::error_t()> > stages[] = {
        {"validate", [&] { return g.validate(); }},
        {"build_operation_graph",
         [&] { return handle_ ? g.build_operation_graph(handle_) : g.build_operation_graph(); }},
        {"create_execution_plans",
         [&] {
           return g.create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK});
         }},
        {"check_support", [&] { return handle_ ? g.check_support(handle_) : g.check_support(); }},
        {"build_plans", [&] { return g.build_plans(fe::BuildPlanPolicy_t::HEURISTICS_CHOICE); }},
    };
    for (const auto& [stage, run] : stages) {
      fe::error_t err;
      try {
        err = run();
      } catch (const std::exception& x) {
        fail(c, backward, key, std::string(stage) + " threw: " + x.what());
      }
      if (err.is_good()) continue;
      const bool plan_build = std::string(stage) == "build_plans";
      const size_t loads =
          plan_build && !handle_ ? plans_stopped_at_module_load(err.get_message()) : 0;
      if (!loads) {
        *why = std::string("refused at ") + stage + ": " + err.get_message();
        return false;
      }
      // Device-less: every plan compiled (NVRTC) and stopped at the module load.
      e.info.plans_stopped_at_module_load = loads;
      e.info.plan_build = err.get_message();
    }
    e.info.executable = e.info.plans_stopped_at_module_load == 0;
    if (e.info.executable) {
      int64_t bytes = 0;
      if (fe::error_t err = g.get_workspace_size(bytes); err.is_bad())
        fail(c, backward, key, "get_workspace_size failed: " + err.get_message());
      e.cudnn_workspace = e.info.workspace_bytes = size_t(bytes);
    }
    return true;
  }

  void build(fe::graph::Graph& g, const SdpaShape& s, const fused::Call& c, const SdpaForward& t,
             const Variant& variant) {
    start(g, s);
    const int64_t b = s.batch, rows = c.rows(), keys = c.keys();
    auto q = bhtd(g, "Q", kQ, b, s.hq, rows, s.d, t.q);
    auto k = bhtd(g, "K", kK, b, s.hkv, keys, s.d, t.k);
    auto v = bhtd(g, "V", kV, b, s.hkv, keys, s.d, t.v);
    auto a = fe::graph::SDPA_attributes().set_name("sdpa").set_generate_stats(true).set_attn_scale(
        s.scale);
    if (variant.composite) a.set_implementation(fe::AttentionImplementation_t::COMPOSITE);
    apply_mask(a, sdpa_mask_of(c));
    auto [o, stats] = g.sdpa(q, k, v, a);
    as_output(o, kO, b, s.hq, rows, s.d, t.o, variant.fp32);
    stats->set_output(true)
        .set_uid(kStats)
        .set_data_type(fe::DataType_t::FLOAT)
        .set_dim({b, s.hq, rows, 1})
        .set_stride({t.lse.b_stride, t.lse.h_stride, t.lse.t_stride, 1});
  }

  void build(fe::graph::Graph& g, const SdpaShape& s, const fused::Call& c, const SdpaBackward& t,
             const Variant& variant) {
    start(g, s);
    const int64_t b = s.batch, rows = c.rows(), keys = c.keys();
    auto q = bhtd(g, "Q", kQ, b, s.hq, rows, s.d, t.q);
    auto k = bhtd(g, "K", kK, b, s.hkv, keys, s.d, t.k);
    auto v = bhtd(g, "V", kV, b, s.hkv, keys, s.d, t.v);
    auto o = bhtd(g, "O", kO, b, s.hq, rows, s.d, t.out);
    auto dout = bhtd(g, "dO", kDO, b, s.hq, rows, s.d, t.dout);
    auto stats = g.tensor(stats_attributes(b, s.hq, rows, dense_rows(rows, s.hq)));  // packed
    auto a =
        fe::graph::SDPA_backward_attributes().set_name("sdpa_backward").set_attn_scale(s.scale);
    apply_mask(a, sdpa_mask_of(c));
    auto [dq, dk, dv] = g.sdpa_backward(q, k, v, o, dout, stats, a);
    as_output(dq, kDQ, b, s.hq, rows, s.d, t.dq, variant.fp32);
    as_output(dk, kDK, b, s.hkv, keys, s.d, t.dk, variant.fp32);
    as_output(dv, kDV, b, s.hkv, keys, s.d, t.dv, variant.fp32);
  }

  void start(fe::graph::Graph& g, const SdpaShape& s) const {
    g.set_io_data_type(s.dtype == DType::bf16 ? fe::DataType_t::BFLOAT16 : fe::DataType_t::FLOAT)
        .set_intermediate_data_type(fe::DataType_t::FLOAT)
        .set_compute_data_type(fe::DataType_t::FLOAT);
    if (props_) g.set_device_properties(props_).set_sm_version(90).set_sm_count(132);
  }

  template <size_t N>
  void execute(const Entry& e, const SdpaShape& s, const fused::Call& c, bool backward,
               std::unordered_map<int64_t, void*>& pack,
               const std::pair<int64_t, SdpaTensor> (&outputs)[N], const SdpaRows* lse,
               void* workspace, cudaStream_t stream) {
    if (!handle_)
      fail(c, backward, e.info.key,
           "this instance is device-less (create_deviceless): its graphs are built, never run");
    auto w = workspace_.find(key_of(s, c, backward));
    if (e.info.workspace_bytes > 0 && (w == workspace_.end() || w->second < e.info.workspace_bytes))
      fail(c, backward, e.info.key,
           "the graph needs " + std::to_string(e.info.workspace_bytes) +
               " B of workspace, more than workspace_bytes() said (" +
               (w == workspace_.end() ? std::string("not asked") : std::to_string(w->second)) +
               ")");
    size_t end = 0;
    const auto scratch = scratch_of(s, c, backward, !e.info.fp32_outputs, e.cudnn_workspace, &end);
    if (lse) {  // the rows' LSE, packed into scratch
      if (lse->t_stride != 1)
        fail(c, backward, e.info.key, "the LSE rows must be contiguous (t stride 1)");
      float* packed =
          reinterpret_cast<float*>(static_cast<char*>(workspace) + scratch.at(kStats).offset);
      launch_copy<float, float>(
          View4<const float>{lse->data + c.q_begin, lse->b_stride, lse->h_stride, 0}, packed,
          s.batch, s.hq, 1, c.rows(), stream);
      pack[kStats] = packed;
    }
    if (!e.info.fp32_outputs)  // the bf16 tier: cuDNN writes into scratch
      for (const auto& [uid, out] : outputs) {
        const Scratch& p = scratch.at(uid);
        if (!is_dense(out, p.t, p.h, s.d))
          fail(c, backward, e.info.key,
               "this graph writes bf16 outputs that are cast into dense fp32 tensors; the "
               "output tensors must be dense [B, T, H, D]");
        pack[uid] = static_cast<char*>(workspace) + p.offset;
      }
    try {
      if (auto st = fe::detail::set_stream(handle_, stream); st != CUDNN_STATUS_SUCCESS)
        fail(c, backward, e.info.key, "cudnnSetStream returned " + std::to_string(int(st)));
      if (fe::error_t err = e.graph->execute(handle_, pack, workspace); err.is_bad())
        fail(c, backward, e.info.key, "execute failed: " + err.get_message());
    } catch (const Error&) {
      throw;
    } catch (const std::exception& x) {
      fail(c, backward, e.info.key, std::string("execute threw: ") + x.what());
    }
    if (!e.info.fp32_outputs)
      for (const auto& [uid, out] : outputs) {
        const Scratch& p = scratch.at(uid);
        const auto* src = reinterpret_cast<const Bf16*>(static_cast<char*>(workspace) + p.offset);
        launch_copy<Bf16, float>(View4<const Bf16>{src, p.t * p.h * s.d, p.h * s.d, s.d},
                                 static_cast<float*>(out.data), s.batch, p.t, p.h, s.d, stream);
      }
  }

  cudnnHandle_t handle_ = nullptr;               // null: device-less
  std::shared_ptr<fe::DeviceProperties> props_;  // device-less: the typed device
  mutable std::mutex mutex_;                     // one cache and one handle per instance
  std::map<std::string, std::unique_ptr<Entry> > cache_;
  std::map<std::string, std::string> refused_;  // key -> why (CudnnRefused's text)
  std::map<std::string, size_t> workspace_;     // key without strides -> bytes (workspace_bytes)
};

}  // namespace

int64_t CudnnAttention::loaded_version() { return loaded; }

std::unique_ptr<CudnnAttention> CudnnAttention::create(std::string* why) {
  std::string failure = load_cudnn();
  if (failure.empty()) {
    cudnnHandle_t handle = nullptr;
    try {
      if (auto st = fe::detail::create_handle(&handle); st != CUDNN_STATUS_SUCCESS)
        failure = "cudnnCreate returned " + std::to_string(int(st)) + " (" +
                  fe::detail::get_error_string(st) + "): no usable GPU or driver";
    } catch (const std::exception& x) {
      failure = std::string("cudnnCreate threw: ") + x.what();
    }
    if (failure.empty()) return std::make_unique<Cudnn>(handle, nullptr);
  }
  if (why) *why = failure;
  return nullptr;
}

std::unique_ptr<CudnnAttention> CudnnAttention::create_deviceless(
    const std::string& properties_json, std::string* why) {
  std::string failure = load_cudnn();
  if (failure.empty()) {
    std::ifstream in(properties_json, std::ios::binary);
    std::vector<uint8_t> json((std::istreambuf_iterator<char>(in)),
                              std::istreambuf_iterator<char>());
    auto props = std::make_shared<fe::DeviceProperties>();
    if (!in && json.empty()) {
      failure = "cannot read the device properties '" + properties_json + "'";
    } else if (fe::error_t e = props->deserialize(json); e.is_bad()) {
      failure = "cuDNN refused the device properties '" + properties_json + "': " + e.get_message();
    } else {
      return std::make_unique<Cudnn>(nullptr, props);
    }
  }
  if (why) *why = failure;
  return nullptr;
}

}  // namespace ctxpar::cuda

#endif

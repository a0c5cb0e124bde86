// cuDNN device-less graph check -- a filter, not a proof (docs/cuda.md, "cuDNN graphs without
// a GPU"). For every SDPA graph the CUDA device would build (bf16 forward with stats and
// backward; each mask form of a fused call: none, causal top-left, causal bottom-right, bands,
// THD ragged for documents; D = 64, 128; GQA), builds the graph with cudnn-frontend in
// device-less mode (a device-properties JSON, sm_90, 132 SMs; the toolkit's stub libcuda.so.1
// on the library path) and runs validation, heuristics, support checks and the plan build
// (NVRTC compile). Only the final module load may fail -- nothing here touches a GPU, and a
// graph that passes may still fail on one. The fp32 backward must be refused: that is why the
// fp32 path is ctxpar's own fallback kernel (src/cuda/tile_math.cuh).
//
// usage: cuda_cudnn_graphs DEVICE_PROPERTIES.json      exit 0 when every expectation holds
//        cuda_cudnn_graphs --save-properties OUT.json  (on a GPU: its properties, for the above)
// One translation unit: the frontend costs a minute of compile time per unit.
#include <cudnn_frontend.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "cuda/sdpa_mask.h"

namespace fe = cudnn_frontend;

namespace {

struct Spec {
  std::string name;
  bool backward = false;
  fe::DataType_t io = fe::DataType_t::BFLOAT16;
  int64_t d = 128, hq = 8, hkv = 2, rows = 256, keys = 256;
  ctxpar::fused::Call call;  // the mask form
  bool ragged = false;       // THD: packed documents, per-sequence lengths and offsets
  enum class Expect { pass, refused, record } expect = Expect::pass;  // record: no assertion
};
using Expect = Spec::Expect;

// How far a graph got: the stage that failed and its message ("" when all passed).
struct Outcome {
  std::string stage, message;
};

std::shared_ptr<fe::graph::Tensor_attributes> tensor_bthd(fe::graph::Graph& g, const char* name,
                                                          int64_t b, int64_t t, int64_t h,
                                                          int64_t d) {
  // Our layout [B, T, H, D] seen as cuDNN's [B, H, T, D] by strides: no transpose.
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_name(name)
                      .set_dim({b, h, t, d})
                      .set_stride({t * h * d, d, h * d, 1}));
}

std::shared_ptr<fe::graph::Tensor_attributes> int_tensor(fe::graph::Graph& g, const char* name,
                                                         int64_t n) {
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_name(name)
                      .set_dim({n, 1, 1, 1})
                      .set_stride({1, 1, 1, 1})
                      .set_data_type(fe::DataType_t::INT32));
}

template <class Attributes>
void apply_mask(Attributes& a, const Spec& s) {
  const ctxpar::cuda::SdpaMask m = ctxpar::cuda::sdpa_mask_of(s.call);
  using A = ctxpar::cuda::SdpaMask::Alignment;
  if (m.alignment == A::none) return;
  a.set_diagonal_alignment(m.alignment == A::top_left ? fe::DiagonalAlignment_t::TOP_LEFT
                                                      : fe::DiagonalAlignment_t::BOTTOM_RIGHT);
  if (m.has_right) a.set_diagonal_band_right_bound(int(m.right));
  if (m.has_left) a.set_diagonal_band_left_bound(int(m.left));
}

Outcome check(const Spec& s, const std::shared_ptr<fe::DeviceProperties>& props) {
  const int64_t b = s.ragged ? 3 : 1;  // ragged: three documents packed
  fe::graph::Graph g;
  g.set_io_data_type(s.io)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  g.set_device_properties(props).set_sm_version(90).set_sm_count(132);
  auto q = tensor_bthd(g, "Q", b, s.rows, s.hq, s.d);
  auto k = tensor_bthd(g, "K", b, s.keys, s.hkv, s.d);
  auto v = tensor_bthd(g, "V", b, s.keys, s.hkv, s.d);
  std::shared_ptr<fe::graph::Tensor_attributes> seq_q, seq_kv;
  if (s.ragged) {
    seq_q = int_tensor(g, "seq_q", b), seq_kv = int_tensor(g, "seq_kv", b);
    for (auto [t, n] : {std::pair{q, "q_offsets"}, {k, "k_offsets"}, {v, "v_offsets"}})
      t->set_ragged_offset(int_tensor(g, n, b + 1));
  }
  const float scale = 1.0f / std::sqrt(float(s.d));
  if (!s.backward) {
    auto a = fe::graph::SDPA_attributes().set_name("sdpa").set_generate_stats(true).set_attn_scale(
        scale);
    apply_mask(a, s);
    if (s.ragged) a.set_padding_mask(true).set_seq_len_q(seq_q).set_seq_len_kv(seq_kv);
    auto [o, stats] = g.sdpa(q, k, v, a);
    o->set_output(true)
        .set_dim({b, s.hq, s.rows, s.d})
        .set_stride({s.rows * s.hq * s.d, s.d, s.hq * s.d, 1});
    if (s.ragged) o->set_ragged_offset(int_tensor(g, "o_offsets", b + 1));
    stats->set_output(true).set_data_type(fe::DataType_t::FLOAT);
  } else {
    auto o = tensor_bthd(g, "O", b, s.rows, s.hq, s.d);
    auto dout = tensor_bthd(g, "dO", b, s.rows, s.hq, s.d);
    auto stats = g.tensor(fe::graph::Tensor_attributes()
                              .set_name("stats")
                              .set_dim({b, s.hq, s.rows, 1})
                              .set_stride({s.hq * s.rows, s.rows, 1, 1})
                              .set_data_type(fe::DataType_t::FLOAT));
    if (s.ragged)
      for (auto [t, n] : {std::pair{o, "o_offsets"}, {dout, "do_offsets"}})
        t->set_ragged_offset(int_tensor(g, n, b + 1));
    auto a = fe::graph::SDPA_backward_attributes().set_name("sdpa_backward").set_attn_scale(scale);
    apply_mask(a, s);
    if (s.ragged) a.set_padding_mask(true).set_seq_len_q(seq_q).set_seq_len_kv(seq_kv);
    auto [dq, dk, dv] = g.sdpa_backward(q, k, v, o, dout, stats, a);
    dq->set_output(true)
        .set_dim({b, s.hq, s.rows, s.d})
        .set_stride({s.rows * s.hq * s.d, s.d, s.hq * s.d, 1});
    for (auto& t : {dk, dv})
      t->set_output(true)
          .set_dim({b, s.hkv, s.keys, s.d})
          .set_stride({s.keys * s.hkv * s.d, s.d, s.hkv * s.d, 1});
  }
  const std::pair<const char*, std::function<fe::error_t()>> stages[] = {
      {"validate", [&] { return g.validate(); }},
      {"build_operation_graph", [&] { return g.build_operation_graph(); }},
      {"create_execution_plans", [&] { return g.create_execution_plans({fe::HeurMode_t::A}); }},
      {"check_support", [&] { return g.check_support(); }},
      {"build_plans", [&] { return g.build_plans(); }},
  };
  for (const auto& [stage, run] : stages) {
    fe::error_t e = run();
    if (e.is_bad()) return {stage, e.get_message()};
  }
  return {};
}

ctxpar::fused::Call call(int64_t rows, int64_t keys, int upper, int lower) {
  ctxpar::fused::Call c;
  c.q_end = rows, c.k_end = keys;
  c.has_upper = upper >= 0, c.upper = upper < 0 ? 0 : upper;
  c.has_lower = lower >= 0, c.lower = lower < 0 ? 0 : lower;
  return c;
}

std::vector<Spec> specs() {
  std::vector<Spec> all;
  struct Form {
    const char* name;
    int64_t rows, keys;
    int upper, lower;  // -1: none
    bool ragged;
  };
  // The forms fused::decompose produces (docs/cuda.md): zigzag's off-diagonal halves and
  // striped's lower blocks (none), diagonal blocks (causal top-left), a query chunk against a
  // longer key run (causal bottom-right), windows (bands), packed documents (THD, causal).
  const Form forms[] = {
      {"none", 256, 256, -1, -1, false},
      {"causal top-left", 256, 256, 0, -1, false},
      {"causal bottom-right", 128, 256, 128, -1, false},
      {"band(upper=0, lower=63)", 256, 256, 0, 63, false},
      {"band(upper=5, lower=40)", 256, 256, 5, 40, false},
      {"band(lower=40 only)", 256, 256, -1, 40, false},
      {"THD documents, causal top-left", 128, 128, 0, -1, true},
  };
  for (int64_t d : {64, 128})
    for (const Form& f : forms)
      for (bool backward : {false, true}) {
        Spec s;
        s.d = d, s.rows = f.rows, s.keys = f.keys, s.backward = backward, s.ragged = f.ragged;
        s.call = call(f.rows, f.keys, f.upper, f.lower);
        s.name = std::string(backward ? "bwd" : "fwd") + " bf16 D=" + std::to_string(d) +
                 " GQA 8/2 " + f.name + " [" + ctxpar::cuda::sdpa_mask_of(s.call).describe() + "]";
        all.push_back(s);
      }
  Spec mha;  // plain multi-head attention, no mask
  mha.hq = mha.hkv = 4, mha.backward = true, mha.name = "bwd bf16 D=128 MHA 4/4 none";
  all.push_back(mha);
  Spec fp32_bwd;  // refused: cuDNN's SDPA backward takes half / bf16 (/ fp8) only
  fp32_bwd.io = fe::DataType_t::FLOAT, fp32_bwd.backward = true, fp32_bwd.expect = Expect::refused;
  fp32_bwd.call = call(256, 256, 0, -1);
  fp32_bwd.name = "bwd fp32 D=128 causal top-left (expected: refused)";
  all.push_back(fp32_bwd);
  // Recorded, not asserted (the device-less filter accepted an fp32 forward and D = 512 once):
  // an fp32 forward, and a head dim that is not a multiple of 8.
  for (auto [io, d, what] : {std::tuple{fe::DataType_t::FLOAT, int64_t{128}, "fwd fp32 D=128"},
                             {fe::DataType_t::BFLOAT16, int64_t{40}, "fwd bf16 D=40"}}) {
    Spec r;
    r.io = io, r.d = d, r.expect = Expect::record, r.call = call(256, 256, 0, -1);
    r.name = std::string(what) + " causal top-left (recorded)";
    all.push_back(r);
  }
  return all;
}

size_t count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// A plan build whose every plan compiled and then failed at the module load (the stub libcuda
// has no GPU behind it: cuLibraryLoadData, CUDA error 34): the one failure device-less mode
// allows, and only in the last stage. Returns the number of such plans, 0 for anything else.
size_t plans_stopped_at_module_load(const Outcome& o) {
  if (o.stage != "build_plans") return 0;
  const size_t plans = count(o.message, "Plan at index");
  return plans > 0 && count(o.message, "cuLibraryLoadData returned error") == plans ? plans : 0;
}

}  // namespace

// On a GPU: the device-properties JSON of device 0, as cuDNN serialises it (scripts/gpu_check.sh
// saves it under docs/data/gpu/; the device-less check then uses it instead of the typed one).
int save_properties(const char* path) {
  cudnnHandle_t handle = nullptr;
  if (cudnnCreate(&handle) != CUDNN_STATUS_SUCCESS) {
    std::fprintf(stderr, "error: cudnnCreate failed: no GPU, or no driver\n");
    return 1;
  }
  fe::DeviceProperties props;
  props.set_handle(handle);
  std::vector<uint8_t> json;
  fe::error_t e = props.build();
  if (e.is_good()) e = props.serialize(json);
  cudnnDestroy(handle);
  if (e.is_bad()) {
    std::fprintf(stderr, "error: device properties: %s\n", e.get_message().c_str());
    return 1;
  }
  std::ofstream(path, std::ios::binary)
      .write(reinterpret_cast<const char*>(json.data()), std::streamsize(json.size()));
  std::printf("device properties of device 0 written to %s\n", path);
  return 0;
}

int main(int argc, char** argv) {
  if (argc == 3 && std::string(argv[1]) == "--save-properties") return save_properties(argv[2]);
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s DEVICE_PROPERTIES.json | --save-properties OUT.json\n",
                 argv[0]);
    return 2;
  }
  std::ifstream in(argv[1], std::ios::binary);
  if (!in) {
    std::fprintf(stderr, "error: cannot read the device properties '%s'\n", argv[1]);
    return 2;
  }
  std::vector<uint8_t> json((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto props = std::make_shared<fe::DeviceProperties>();
  if (fe::error_t e = props->deserialize(json); e.is_bad()) {
    std::fprintf(stderr, "error: cuDNN refused the device properties '%s': %s\n", argv[1],
                 e.get_message().c_str());
    return 1;
  }
  std::printf("cuDNN %zu, cudnn-frontend %d, device-less (sm_90, 132 SMs, %s)\n", cudnnGetVersion(),
              CUDNN_FRONTEND_VERSION, argv[1]);
  int failures = 0, passed = 0;
  for (const Spec& s : specs()) {
    const Outcome o = check(s, props);
    const size_t loads = plans_stopped_at_module_load(o);
    const bool refused = !o.stage.empty() && loads == 0;
    const bool ok = s.expect == Expect::record || refused == (s.expect == Expect::refused);
    failures += !ok;
    passed += !refused;
    std::string what = "passed every stage: plans built and loaded";
    if (loads)
      what = "passed validation, heuristics and support checks; " + std::to_string(loads) +
             " plan(s) compiled, each stopped at the module load (cuLibraryLoadData, no GPU)";
    if (refused) what = "refused at " + o.stage + ": " + o.message;
    std::printf("%-4s %s\n     %s\n", ok ? "ok" : "FAIL", s.name.c_str(), what.c_str());
  }
  std::printf("%d graphs passed the device-less filter; %d expectations failed\n", passed,
              failures);
  return failures ? 1 : 0;
}

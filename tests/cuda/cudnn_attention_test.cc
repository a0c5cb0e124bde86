// The cuDNN execution path (src/cuda/cudnn_attention.cc) in cuDNN's device-less mode: a
// filter, not a proof (docs/cuda.md). CudnnAttention's own graph building runs for the calls of
// real decompositions (fused::decompose of contiguous / zigzag / striped blocks under causal,
// window and documents masks, D = 64 and 128, GQA 8/2), forward and backward, through
// validation, heuristics, support checks and every plan's NVRTC compile; the test asserts that
// the only failure is each plan's module load (no GPU behind the stub libcuda.so.1), that the
// graph cache returns the same graph for the same key and a new one for a new mask form, and
// records which output type (fp32 or the bf16 tier) each graph got.
// Environment (the ctest entry sets it): CTXPAR_CUDNN_PROPERTIES, a cuDNN device-properties
// JSON; LD_LIBRARY_PATH with the stub driver as libcuda.so.1 and libcudnn.so.9.
// No frontend header here: the one unit that includes it is the library's.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "ctxpar/error.h"
#include "ctxpar/layout.h"
#include "ctxpar/mask.h"
#include "cuda/cudnn_attention.h"
#include "device/fused_calls.h"

namespace ctxpar::cuda {
namespace {

// A fresh device-less instance (an empty graph cache).
std::unique_ptr<CudnnAttention> deviceless() {
  const char* props = std::getenv("CTXPAR_CUDNN_PROPERTIES");
  if (!props) {
    std::fprintf(stderr,
                 "CTXPAR_CUDNN_PROPERTIES is not set: run through ctest (it names the "
                 "device-properties JSON)\n");
    std::abort();
  }
  std::string why;
  auto a = CudnnAttention::create_deviceless(props, &why);
  if (!a) {
    std::fprintf(stderr, "create_deviceless: %s\n", why.c_str());
    std::abort();
  }
  return a;
}

SdpaTensor dense(int64_t t, int64_t h, int64_t d) { return {nullptr, t * h * d, h * d, d}; }

// The tensors the cuda device passes for a (query block, K/V block) pair: whole blocks
// [1, T, H, D] contiguous, call-local dense outputs.
SdpaForward forward_tensors(const SdpaShape& s, const fused::Call& c, int64_t tq, int64_t tk) {
  SdpaForward f;
  f.q = dense(tq, s.hq, s.d);
  f.k = f.v = dense(tk, s.hkv, s.d);
  f.o = dense(c.rows(), s.hq, s.d);
  f.lse = {nullptr, s.hq * c.rows(), c.rows(), 1};
  return f;
}
SdpaBackward backward_tensors(const SdpaShape& s, const fused::Call& c, int64_t tq, int64_t tk) {
  SdpaBackward b;
  b.q = b.out = b.dout = dense(tq, s.hq, s.d);
  b.k = b.v = dense(tk, s.hkv, s.d);
  b.lse = {nullptr, s.hq * tq, tq, 1};  // the rows' final LSE, whole block
  b.dq = dense(c.rows(), s.hq, s.d);
  b.dk = b.dv = dense(c.keys(), s.hkv, s.d);
  return b;
}

SdpaShape shape(int64_t d) {
  SdpaShape s;
  s.batch = 1, s.hq = 8, s.hkv = 2, s.d = d, s.scale = 1.0f / std::sqrt(float(d));
  return s;
}

// Device-less: the plans compiled, each stopped at the module load, and nothing else failed
// (any other failure throws out of prepare()).
void expect_only_module_load(const SdpaPrepared& p, const std::string& what) {
  EXPECT_FALSE(p.executable) << what;
  EXPECT_GT(p.plans_stopped_at_module_load, 0u) << what << ": " << p.plan_build;
}

struct Case {
  const char* name;
  LayoutKind kind;
  Mask mask;
  int64_t d;
};

TEST(CudnnAttention, DecompositionCallsBuildUpToTheModuleLoad) {
  const auto instance = deviceless();
  CudnnAttention& a = *instance;
  // Small blocks (T = 64 over two ranks): each distinct graph costs seconds of NVRTC.
  const int64_t t = 64;
  const int p = 2;
  Mask window;  // a sliding window, causal: bands
  window.causal = true, window.window_left = 12;
  Mask documents = Mask::causal_mask();
  documents.documents = true;
  std::vector<int32_t> docs(t);
  for (int64_t i = 0; i < t; ++i) docs[i] = i < 20 ? 0 : i < 50 ? 1 : 2;
  const Case cases[] = {
      {"zigzag causal", LayoutKind::zigzag, Mask::causal_mask(), 64},
      {"contiguous window", LayoutKind::contiguous, window, 64},
      {"striped causal", LayoutKind::striped, Mask::causal_mask(), 128},
      {"contiguous documents", LayoutKind::contiguous, documents, 128},
  };
  std::set<std::string> keys;
  std::map<std::string, std::string> tiers;  // "fwd/bwd mask form" -> output types seen
  int calls = 0;
  for (const Case& k : cases) {
    const Layout layout(k.kind, t, p);
    const SdpaShape s = shape(k.d);
    ASSERT_TRUE(a.supports(s));
    for (int rq = 0; rq < p; ++rq)
      for (int rk = 0; rk < p; ++rk) {
        const auto qpos = layout.token_positions(rq), kpos = layout.token_positions(rk);
        std::vector<int32_t> qdoc, kdoc;
        if (k.mask.documents) qdoc = layout.shard(docs, rq, -1), kdoc = layout.shard(docs, rk, -1);
        const int64_t tq = int64_t(qpos.size()), tk = int64_t(kpos.size());
        for (const fused::Call& c : fused::decompose({qpos, qdoc}, {kpos, kdoc}, k.mask)) {
          for (bool backward : {false, true}) {
            const std::string what = std::string(k.name) + " D=" + std::to_string(k.d) +
                                     " q rank " + std::to_string(rq) + " k rank " +
                                     std::to_string(rk) + " " + (backward ? "bwd " : "fwd ") +
                                     c.describe();
            SdpaPrepared prep;
            try {
              prep = backward ? a.prepare(s, c, backward_tensors(s, c, tq, tk))
                              : a.prepare(s, c, forward_tensors(s, c, tq, tk));
            } catch (const Error& e) {
              FAIL() << what << ": " << e.what();
            }
            expect_only_module_load(prep, what);
            keys.insert(prep.key);
            std::string form = c.describe();
            if (form.rfind("band", 0) == 0) form = "band";
            tiers[std::string(backward ? "bwd " : "fwd ") + form] +=
                prep.fp32_outputs ? "fp32 " : "bf16 ";
            ++calls;
          }
        }
      }
  }
  EXPECT_EQ(a.graphs_built(), keys.size()) << "a graph built twice for one key";
  std::printf("%d calls, %zu distinct graphs\n", calls, keys.size());
  for (const auto& [form, seen] : tiers) {
    const bool fp32 = seen.find("fp32") != std::string::npos;
    const bool bf16 = seen.find("bf16") != std::string::npos;
    std::printf("  %-28s outputs: %s\n", form.c_str(),
                fp32 && bf16 ? "fp32 and bf16"
                : fp32       ? "fp32"
                             : "bf16 (cast to fp32)");
    RecordProperty(form, fp32 && bf16 ? "fp32 and bf16" : fp32 ? "fp32" : "bf16");
  }
}

TEST(CudnnAttention, CacheReturnsTheSameGraphForTheSameKeyAndANewOneForANewMaskForm) {
  const auto instance = deviceless();
  CudnnAttention& a = *instance;
  const SdpaShape s = shape(64);
  fused::Call causal;
  causal.q_end = causal.k_end = 64, causal.has_upper = true;  // causal top-left, 64 x 64
  fused::Call none = causal;
  none.has_upper = false;
  const SdpaForward tc = forward_tensors(s, causal, 64, 64);
  const SdpaPrepared first = a.prepare(s, causal, tc);
  const size_t built = a.graphs_built();
  const SdpaPrepared again = a.prepare(s, causal, tc);
  EXPECT_EQ(again.graph_id, first.graph_id);
  EXPECT_EQ(a.graphs_built(), built) << "the same key built a second graph";
  // The same call at other rows of the block: the same graph (pointer offsets, not a new key).
  fused::Call shifted = causal;
  shifted.q_begin += 64, shifted.q_end += 64, shifted.k_begin += 64, shifted.k_end += 64;
  EXPECT_EQ(a.prepare(s, shifted, forward_tensors(s, shifted, 64, 64)).graph_id, first.graph_id);
  EXPECT_EQ(a.graphs_built(), built);
  const SdpaPrepared other = a.prepare(s, none, forward_tensors(s, none, 64, 64));
  EXPECT_NE(other.graph_id, first.graph_id);
  EXPECT_NE(other.key, first.key);
  EXPECT_EQ(a.graphs_built(), built + 1);
  expect_only_module_load(other, "no mask 64 x 64");
}

TEST(CudnnAttention, SupportsBf16WithHeadDimsInMultiplesOfEightUpTo256) {
  const auto instance = deviceless();
  CudnnAttention& a = *instance;
  SdpaShape s = shape(64);
  EXPECT_TRUE(a.supports(s));
  s.d = 256;
  EXPECT_TRUE(a.supports(s));
  s.d = 264;
  EXPECT_FALSE(a.supports(s));
  s.d = 40 - 4;
  EXPECT_FALSE(a.supports(s));
  s = shape(64), s.dtype = DType::f32;
  EXPECT_FALSE(a.supports(s)) << "fp32 storage goes to the fallback kernel (exact path)";
  s = shape(64), s.hkv = 3;
  EXPECT_FALSE(a.supports(s));
}

TEST(CudnnAttention, DevicelessInstanceRefusesToExecuteNamingTheCall) {
  const auto instance = deviceless();
  CudnnAttention& a = *instance;
  const SdpaShape s = shape(64);
  fused::Call causal;
  causal.q_end = causal.k_end = 64, causal.has_upper = true;
  try {
    a.forward(s, causal, forward_tensors(s, causal, 64, 64), nullptr, nullptr);
    FAIL() << "forward ran on a device-less instance";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("causal top-left"), std::string::npos) << m;
    EXPECT_NE(m.find("rows=64 keys=64"), std::string::npos) << m;
    EXPECT_NE(m.find("device-less"), std::string::npos) << m;
  }
}

// Without a GPU, create() finds libcudnn but no device: nullptr and why.
TEST(CudnnAttention, CreateWithoutAGpuSaysWhy) {
  std::string why;
  EXPECT_EQ(CudnnAttention::create(&why), nullptr);
  EXPECT_NE(why.find("cudnnCreate"), std::string::npos) << why;
}

}  // namespace
}  // namespace ctxpar::cuda

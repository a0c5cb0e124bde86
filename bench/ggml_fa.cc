// ggml's CPU flash attention (ggml_flash_attn_ext, the kernel llama.cpp runs on a CPU) timed at
// the shape of `ctxpar bench kernel`, for the CPU suite's "against ggml" row. Not part of ctxpar's
// build: ggml is not a dependency, and neither its code nor a script that fetches or builds it
// is in this repository. Build it by hand against a ggml checkout of your own (CPU backend,
// static libraries), then give the binary to the suite:
//
//   cmake -S $GGML -B $GGML/build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON
//         -DGGML_BUILD_TESTS=OFF -DGGML_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF
//   ninja -C $GGML/build ggml ggml-cpu ggml-base
//   g++ -O2 -fopenmp bench/ggml_fa.cc -I$GGML/include -o /tmp/ggml_fa -Wl,--start-group
//       $GGML/build/src/libggml.a $GGML/build/src/libggml-cpu.a $GGML/build/src/libggml-base.a
//       -Wl,--end-group -lpthread -ldl
//   (each command on one line)
//   /tmp/ggml_fa --seq 4096 --heads 8 --head-dim 128 --threads 2 --kv f32 --repeats 1
//   bash bench/cpu_suite.sh --ggml /tmp/ggml_fa ...
//
// Forward only (ggml has no attention backward), non-causal, B = 1, fp32 q; K/V in fp32 (same
// inputs as ctxpar's fp32 rows) or fp16 (llama.cpp's default KV cache). Random inputs in
// [-0.5, 0.5). Timed: ggml_graph_compute_with_ctx on a graph holding the one op, best of
// --repeats after one untimed run. FLOPs as `bench kernel` counts them: 4 * H * T * T * D.
// Before timing, 8 query rows of head 0 are checked against an fp64 softmax(q k^T / sqrt(D)) v
// of the same (fp16-rounded, for --kv f16) inputs, so a figure is never that of a wrong result:
// exit 1 when the largest error is over 1e-3 (ggml accumulates in fp32; a correct result is
// around 1e-6 here). Prints one JSON object.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "ggml-cpu.h"
#include "ggml.h"

namespace {

[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr,
               "ggml_fa: %s\nusage: ggml_fa --seq T --heads H --head-dim D --threads N "
               "[--kv f32|f16] [--repeats R]\n",
               why);
  std::exit(2);
}

int positive(const char* name, const char* text) {
  char* end = nullptr;
  const long v = std::strtol(text, &end, 10);
  if (end == text || *end != '\0' || v < 1 || v > (1L << 20))
    usage((std::string(name) + " needs a whole number from 1 to 1048576, got '" + text + "'")
              .c_str());
  return static_cast<int>(v);
}

float element(const ggml_tensor* t, int64_t i) {
  return t->type == GGML_TYPE_F16 ? ggml_fp16_to_fp32(static_cast<const ggml_fp16_t*>(t->data)[i])
                                  : static_cast<const float*>(t->data)[i];
}

}  // namespace

int main(int argc, char** argv) {
  int T = 0, H = 0, D = 0, threads = 0, repeats = 1;
  bool f16 = false;
  for (int i = 1; i < argc; i += 2) {
    const std::string a = argv[i];
    if (i + 1 >= argc) usage((a + " needs a value").c_str());
    const char* v = argv[i + 1];
    if (a == "--seq")
      T = positive("--seq", v);
    else if (a == "--heads")
      H = positive("--heads", v);
    else if (a == "--head-dim")
      D = positive("--head-dim", v);
    else if (a == "--threads")
      threads = positive("--threads", v);
    else if (a == "--repeats")
      repeats = positive("--repeats", v);
    else if (a == "--kv") {
      if (std::strcmp(v, "f32") != 0 && std::strcmp(v, "f16") != 0)
        usage(("--kv is f32 or f16, got '" + std::string(v) + "'").c_str());
      f16 = std::strcmp(v, "f16") == 0;
    } else
      usage(("unknown option '" + a + "'").c_str());
  }
  if (T == 0 || H == 0 || D == 0 || threads == 0)
    usage("--seq, --heads, --head-dim and --threads are required");

  const size_t bytes = static_cast<size_t>(T) * H * D * sizeof(float) * 4 + (size_t{64} << 20);
  ggml_init_params params = {bytes, nullptr, false};
  ggml_context* ctx = ggml_init(params);
  if (!ctx) usage("ggml_init failed (out of memory?)");
  const ggml_type kv_type = f16 ? GGML_TYPE_F16 : GGML_TYPE_F32;
  // ggml's order: q [D, T, H], k and v [D, T, H] (not transposed); the result is [D, H, T].
  ggml_tensor* q = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, D, T, H);
  ggml_tensor* k = ggml_new_tensor_3d(ctx, kv_type, D, T, H);
  ggml_tensor* v = ggml_new_tensor_3d(ctx, kv_type, D, T, H);
  uint64_t state = 0x9e3779b97f4a7c15ull;
  auto fill = [&state](ggml_tensor* t) {
    for (int64_t i = 0; i < ggml_nelements(t); ++i) {
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      const float x = static_cast<float>(state >> 40) / static_cast<float>(1 << 24) - 0.5f;
      if (t->type == GGML_TYPE_F16)
        static_cast<ggml_fp16_t*>(t->data)[i] = ggml_fp32_to_fp16(x);
      else
        static_cast<float*>(t->data)[i] = x;
    }
  };
  fill(q), fill(k), fill(v);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  ggml_tensor* out = ggml_flash_attn_ext(ctx, q, k, v, nullptr, scale, 0.0f, 0.0f);
  ggml_flash_attn_ext_set_prec(out, GGML_PREC_F32);
  ggml_cgraph* graph = ggml_new_graph(ctx);
  ggml_build_forward_expand(graph, out);

  if (ggml_graph_compute_with_ctx(ctx, graph, threads) != GGML_STATUS_SUCCESS)
    usage("ggml_graph_compute_with_ctx failed");
  // fp64 check of 8 query rows of head 0, spread over the sequence.
  double max_err = 0;
  std::vector<double> s(T), o(D);
  for (int n = 0; n < 8; ++n) {
    const int64_t t = static_cast<int64_t>(n) * (T - 1) / 7;
    double mx = -INFINITY;
    for (int64_t j = 0; j < T; ++j) {
      double dot = 0;
      for (int64_t c = 0; c < D; ++c) dot += double(element(q, t * D + c)) * element(k, j * D + c);
      s[j] = dot * scale;
      mx = std::max(mx, s[j]);
    }
    double sum = 0;
    std::fill(o.begin(), o.end(), 0.0);
    for (int64_t j = 0; j < T; ++j) {
      const double p = std::exp(s[j] - mx);
      sum += p;
      for (int64_t c = 0; c < D; ++c) o[c] += p * element(v, j * D + c);
    }
    for (int64_t c = 0; c < D; ++c) {
      const double got =
          static_cast<const float*>(out->data)[c + int64_t{D} * (0 + int64_t{H} * t)];
      max_err = std::max(max_err, std::abs(got - o[c] / sum));
    }
  }
  if (!(max_err <= 1e-3)) {
    std::fprintf(stderr, "ggml_fa: ggml's result differs from the fp64 reference by %.3g\n",
                 max_err);
    return 1;
  }
  double best = INFINITY;
  for (int r = 0; r < repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    ggml_graph_compute_with_ctx(ctx, graph, threads);
    best = std::min(best,
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  const double flops = 4.0 * H * double(T) * T * D;
  std::printf(
      "{\"impl\": \"ggml_flash_attn_ext\", \"ggml_version\": \"%s\", \"ggml_commit\": \"%s\", "
      "\"seq\": %d, \"heads\": %d, \"head_dim\": %d, \"threads\": %d, \"kv\": \"%s\", "
      "\"fwd_seconds\": %.6f, \"fwd_gflops\": %.2f, \"max_err_vs_fp64\": %.3g}\n",
      ggml_version(), ggml_commit(), T, H, D, threads, f16 ? "f16" : "f32", best,
      flops / best / 1e9, max_err);
  ggml_free(ctx);
  return 0;
}

// Lab 03: the library's fast path (src/kernel/simd_forward.cc): K packed transposed and V
// row-major once per call, a 6 x 4-vector register-blocked micro-kernel (AVX-512; 6 x 2 on
// AVX2) for S = Q K^T and O += P V, exp2 as a vector polynomial fused with the row sum, Q
// pre-scaled by scale * log2(e), lazy rescaling. Run through the public API, one thread.
//   ./build/dev/lab_03_simd [T] [H] [D]
#include "core/environment.h"
#include "ctxpar/kernel.h"
#include "lab_common.h"

int main(int argc, char** argv) {
  ctxpar::set_kernel_environment(ctxpar::environment::kernel());  // CTXPAR_SIMD
  lab::Problem p(argc, argv);
  ctxpar::ForwardState state(1, p.t, p.h, p.d);
  ctxpar::Tensor o(ctxpar::DType::f32, {1, p.t, p.h, p.d}), lse(ctxpar::DType::f32, {1, p.h, p.t});
  std::vector<float> out(p.t * p.h * p.d);
  const ctxpar::Tokens tokens{p.pos, {}};
  auto run = [&] {
    state.reset();
    ctxpar::attention_forward_block(p.q, tokens, p.k, p.v, tokens, ctxpar::Mask{}, state);
    ctxpar::attention_forward_finalize(state, o, lse);
    std::copy_n(o.ptr<float>(), out.size(), out.data());
  };
  return lab::report("03_simd", p, run, out);
}

// Ten lines a downstream project writes: one causal attention block through the installed API.
#include <ctxpar/kernel.h>
#include <cstdio>
#include <numeric>
int main() {
  ctxpar::Tensor q(ctxpar::DType::f32, {1, 8, 2, 16}), out(ctxpar::DType::f32, {1, 8, 2, 16}),
      lse(ctxpar::DType::f32, {1, 2, 8});
  ctxpar::fill_normal(q.view(), 1);
  std::vector<int64_t> pos(8);
  std::iota(pos.begin(), pos.end(), 0);
  ctxpar::ForwardState state(1, 8, 2, 16);
  ctxpar::attention_forward_block(q, {pos, {}}, q, q, {pos, {}}, ctxpar::Mask::causal_mask(),
                                  state);
  ctxpar::attention_forward_finalize(state, out, lse);
  std::printf("consumer ok: lse[0] = %.6f\n", lse.ptr<float>()[0]);
  return lse.ptr<float>()[0] == lse.ptr<float>()[0] ? 0 : 1;  // not NaN
}

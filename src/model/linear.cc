// Linear layers through BLAS (OpenBLAS). Weights are [out, in] as in PyTorch, so a checkpoint
// maps onto nn.Linear without transposes.
#include <cblas.h>

#include "model/layers.h"

namespace ctxpar::model {

void linear_forward(const float* x, const float* w, float* y, int64_t n, int64_t in, int64_t out) {
  // x [N, in] . w^T [in, out] -> y [N, out]
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, out, in, 1.0f, x, in, w, in, 0.0f, y,
              out);
}

void linear_backward(const float* dy, const float* x, const float* w, float* dx, float* dw,
                     int64_t n, int64_t in, int64_t out, bool accumulate_dx) {
  // dx [N, in] = dy [N, out] . w [out, in]
  if (dx)
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, in, out, 1.0f, dy, out, w, in,
                accumulate_dx ? 1.0f : 0.0f, dx, in);
  // dw [out, in] += dy^T [out, N] . x [N, in]
  if (dw)
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, out, in, n, 1.0f, dy, out, x, in, 1.0f, dw,
                in);
}

}  // namespace ctxpar::model

// The kernel choices that change bits, agreed by the ranks (kernel_agreement.h).
#include "device/kernel_agreement.h"

#include "kernel/problem.h"

namespace ctxpar::device {

void agree_kernel_choices(Communicator& comm) {
  if (comm.size() == 1) return;
  // The lowest level any rank wants (0 fp32, 1 vdpbf16ps, 2 AMX), by summed counts: how many
  // ranks want at least 1, at least 2.
  const int level = kernel::bf16_products_wanted();
  double at_least[2] = {level >= 1 ? 1.0 : 0.0, level >= 2 ? 1.0 : 0.0};
  comm.allreduce(at_least, 2);
  const double n = comm.size();
  kernel::bf16_products_agreed_at_most(at_least[1] == n ? 2 : at_least[0] == n ? 1 : 0);
}

}  // namespace ctxpar::device

// The kernel choices that change bits, agreed by the ranks (kernel_agreement.h).
#include "device/kernel_agreement.h"

#include "kernel/problem.h"

namespace ctxpar::device {

std::string kernel_choices_error(const KernelConfig& config) {
  return kernel::bf16_products_refusal(config.bf16_products);
}

void agree_kernel_choices(Communicator& comm, KernelConfig& config) {
  if (comm.size() == 1) return;
  // The lowest level any rank takes (0 fp32, 1 vdpbf16ps, 2 AMX), by summed counts: how many
  // ranks take at least 1, at least 2.
  const int level = kernel::bf16_products_level(config.bf16_products);
  double at_least[2] = {level >= 1 ? 1.0 : 0.0, level >= 2 ? 1.0 : 0.0};
  comm.allreduce(at_least, 2);
  const double n = comm.size();
  config.bf16_products = kernel::bf16_products_of_level(at_least[1] == n   ? 2
                                                        : at_least[0] == n ? 1
                                                                           : 0);
}

}  // namespace ctxpar::device

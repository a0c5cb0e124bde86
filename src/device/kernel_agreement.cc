// The kernel choices that change bits, agreed by the ranks (kernel_agreement.h).
#include "device/kernel_agreement.h"

#include "kernel/problem.h"

namespace ctxpar::device {

void agree_kernel_choices(Communicator& comm) {
  if (comm.size() == 1) return;
  double wanted = kernel::bf16_products_wanted() ? 1 : 0;
  comm.allreduce(&wanted, 1);
  if (wanted < comm.size()) kernel::bf16_products_agreed_off();
}

}  // namespace ctxpar::device

// Private: the kernel choices that change bits, agreed by the ranks before they compute
// together (Note [The ranks agree on bf16 products], src/kernel/problem.h).
#pragma once
#include <string>

#include "ctxpar/comm.h"
#include "ctxpar/kernel.h"

namespace ctxpar::device {

// "" where this machine can take the bf16 products `config` asks for, else why not (naming
// KernelConfig::bf16_products): a rank's local error for the agreement that precedes this one.
std::string kernel_choices_error(const KernelConfig& config);

// Collective on every rank of `comm` (one allreduce of two doubles; nothing with one rank):
// config.bf16_products becomes the lowest level any rank takes (automatic: this machine's
// choice), so that bf16 products stay on only where every rank takes them and AMX and
// vdpbf16ps are never mixed. Only `config` changes: an agreement on one communicator leaves
// every other strategy and cache alone. Strategy::create and the first prefill or decode of a
// KvCache call it on their own options before any other communication of theirs.
void agree_kernel_choices(Communicator& comm, KernelConfig& config);

}  // namespace ctxpar::device

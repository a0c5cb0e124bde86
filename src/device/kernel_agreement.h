// Private: the kernel choices that change bits, agreed by the ranks before they compute
// together (Note [The ranks agree on bf16 products], src/kernel/problem.h).
#pragma once
#include "ctxpar/comm.h"

namespace ctxpar::device {

// Collective on every rank of `comm` (one allreduce of one double; nothing with one rank):
// bf16 products stay on only where every rank wants them. Strategy::create and the first
// prefill or decode of a KvCache call it before any other communication of theirs.
void agree_kernel_choices(Communicator& comm);

}  // namespace ctxpar::device

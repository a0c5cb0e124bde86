// Runs P gloo ranks as threads of one test process: each makes its own GlooBootstrap (its own
// TCP device on the loopback), the addresses are exchanged in memory, and fn runs on each
// rank's communicator. Exceptions are collected per rank (not rethrown), so a test can assert
// what every rank saw.
#pragma once
#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "ctxpar/comm.h"

namespace ctxpar::testing {

// messages[r]: what rank r's fn threw ("" if it returned).
std::vector<std::string> run_gloo_threads(
    int ranks, const std::function<void(Communicator&)>& fn,
    std::chrono::milliseconds timeout = std::chrono::seconds(60));

}  // namespace ctxpar::testing

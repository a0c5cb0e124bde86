#include "gloo/gloo_support.h"

#include <barrier>
#include <thread>

#include "ctxpar/gloo.h"

namespace ctxpar::testing {

std::vector<std::string> run_gloo_threads(int ranks, const std::function<void(Communicator&)>& fn,
                                          std::chrono::milliseconds timeout) {
  std::vector<std::string> addresses(ranks), errors(ranks);
  std::barrier sync(ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r)
    threads.emplace_back([&, r] {
      std::unique_ptr<Communicator> comm;
      try {
        GlooOptions options;
        options.hostname_or_interface = "127.0.0.1";
        options.timeout = timeout;
        GlooBootstrap boot(r, ranks, options);
        addresses[r] = boot.address();
        sync.arrive_and_wait();
        comm = boot.connect(addresses);
        fn(*comm);
      } catch (const std::exception& e) {
        errors[r] = e.what();
        if (errors[r].empty()) errors[r] = "(empty message)";
      }
    });
  for (auto& t : threads) t.join();
  return errors;
}

}  // namespace ctxpar::testing

// The gloo transport for Python (include/ctxpar/gloo.h): ctxpar._GlooBootstrap, which
// Communicator.from_torch drives (address() exchanged over a torch ProcessGroup, then
// connect), and ctxpar._gloo_from_torchrun_env, ctxpar.init()'s path under torchrun. Both
// block in C++ with the GIL released; the communicators they return are owned by Python.
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "communicator.h"
#include "core/environment.h"
#include "ctxpar/gloo.h"

namespace ctxpar::python {

namespace {
// The environment is read here, at the edge: CTXPAR_GLOO_IFNAME / CTXPAR_GLOO_HOST choose
// the address (environment::gloo_interface).
GlooOptions gloo_options(int64_t timeout_ms) {
  GlooOptions options;
  options.timeout = std::chrono::milliseconds(timeout_ms);
  options.hostname_or_interface = environment::gloo_interface();
  return options;
}

PyCommunicator owned(std::unique_ptr<Communicator> comm, int64_t timeout_ms) {
  comm->set_timeout(std::chrono::milliseconds(timeout_ms));
  return PyCommunicator(std::shared_ptr<Communicator>(std::move(comm)));
}
}  // namespace

void bind_gloo(nb::module_& m) {
  nb::class_<GlooBootstrap>(m, "_GlooBootstrap",
                            "One rank's listening address; connect() to every rank's.")
      .def(
          "__init__",
          [](GlooBootstrap* self, int rank, int size, int64_t timeout_ms) {
            GlooOptions options = gloo_options(timeout_ms);
            nb::gil_scoped_release release;
            new (self) GlooBootstrap(rank, size, options);
          },
          nb::arg("rank"), nb::arg("size"), nb::arg("timeout_ms"))
      // Opaque bytes, not text: Python bytes both ways.
      .def("address",
           [](const GlooBootstrap& self) {
             const std::string a = self.address();
             return nb::bytes(a.data(), a.size());
           })
      .def(
          "connect",
          [](GlooBootstrap& self, const std::vector<nb::bytes>& given, int64_t timeout_ms) {
            std::vector<std::string> addresses;
            for (const nb::bytes& a : given) addresses.emplace_back(a.c_str(), a.size());
            std::unique_ptr<Communicator> comm;
            {
              nb::gil_scoped_release release;
              comm = self.connect(addresses);
            }
            return owned(std::move(comm), timeout_ms);
          },
          nb::arg("addresses"), nb::arg("timeout_ms"));
  m.def("_gloo_available", &gloo_available);
  m.def("_gloo_failed_rank",
        [](const PyCommunicator& c) { return c.closed() ? -1 : gloo_failed_rank(c.get()); });
  m.def("_gloo_from_torchrun_env", [](int64_t timeout_ms) {
    std::unique_ptr<Communicator> comm;
    {
      nb::gil_scoped_release release;
      comm = gloo_from_torchrun_env(gloo_options(timeout_ms));
    }
    return owned(std::move(comm), timeout_ms);
  });
}

}  // namespace ctxpar::python

// ctxpar._ctxpar._require_agreement: the library's cross-rank agreement (ctxpar/agreement.h),
// so that the Python package refuses ranks called with different arguments with the very
// function (and the very message) the strategies and the command use.
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "communicator.h"
#include "ctxpar/agreement.h"

namespace ctxpar::python {

void bind_agreement(nb::module_& m) {
  m.def(
      "_require_agreement",
      [](const PyCommunicator& comm, const std::string& what, const Signature& signature,
         const std::string& local_error) {
        Communicator& c = comm.get();
        nb::gil_scoped_release release;  // the other ranks may be threads of this process
        require_agreement(c, what, signature, local_error);
      },
      nb::arg("comm"), nb::arg("what"), nb::arg("signature"), nb::arg("local_error") = "",
      "Collective: every rank passes its [(field, value text), ...]; raises the same ValueError "
      "on every rank naming the first field that differs (or the ranks with a local_error).");
}

}  // namespace ctxpar::python

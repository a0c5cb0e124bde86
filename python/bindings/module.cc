// ctxpar._ctxpar: the C++ side of the Python package (python/ctxpar/). nanobind, for its
// nb::ndarray (DLPack in, zero-copy, device and dtype visible) and small, fast-building
// bindings. See docs/python.md.
#include <nanobind/nanobind.h>

#include "communicator.h"
#include "core/environment.h"
#include "ctxpar/comm.h"
#include "ctxpar/limits.h"

namespace ctxpar::python {
void bind_attention(nb::module_& m);
void bind_agreement(nb::module_& m);
void bind_inference(nb::module_& m);  // inference.cc: ctxpar.KVCache
void bind_gloo(nb::module_& m);       // gloo.cc, where the library has its gloo transport
void bind_mpi(nb::module_& m);        // mpi_loader.cc: the MPI transport, loaded when asked for
}  // namespace ctxpar::python

NB_MODULE(_ctxpar, m) {
  namespace nb = nanobind;
  m.attr("__version__") = CTXPAR_VERSION;
  // The kernel's environment variables (CTXPAR_SIMD, ...), read once, as the command reads them.
  ctxpar::set_kernel_environment(ctxpar::environment::kernel());
  // The library's ranges (ctxpar/limits.h, comm.h), which ctxpar._checks holds
  // every argument to, as the command holds its options.
  nb::dict limits;
  limits["threads"] = ctxpar::kMaxThreads;
  limits["threads_ranks"] = ctxpar::kMaxThreadsRanks;
  limits["processes"] = ctxpar::kMaxProcesses;
  limits["tokens"] = ctxpar::kMaxTokens;
  limits["heads"] = ctxpar::kMaxHeads;
  limits["batch"] = ctxpar::kMaxBatch;
  limits["min_timeout"] = ctxpar::kMinTimeout;
  limits["max_timeout"] = ctxpar::kMaxTimeout;
  m.attr("_limits") = limits;
  // torch's autograd graph keeps the communicator and options it saved (ctx) alive until
  // interpreter exit; nanobind would report them as leaks.
  nb::set_leak_warnings(false);
  // A ctxpar::Error is a user mistake the library found (its message says what and how to
  // fix it), so it is a ValueError to Python code.
  nb::exception<ctxpar::Error>(m, "Error", PyExc_ValueError);
  ctxpar::python::bind_communicator(m);
  ctxpar::python::bind_attention(m);
  ctxpar::python::bind_agreement(m);
  ctxpar::python::bind_inference(m);
  ctxpar::python::bind_mpi(m);
#ifdef CTXPAR_PYTHON_GLOO
  ctxpar::python::bind_gloo(m);
#endif
}

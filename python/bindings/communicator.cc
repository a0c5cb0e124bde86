#include "communicator.h"

#include <algorithm>
#include <chrono>
#include <mutex>
#include <optional>
#include <string>

#include <nanobind/stl/function.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>

#include "ctxpar/launch.h"

namespace ctxpar::python {

Communicator& PyCommunicator::get() const {
  if (closed_)
    throw nb::value_error(
        "communicator: closed (by close(), or by ctxpar at the interpreter's exit); make a new "
        "one (Communicator.from_torch, ctxpar.init)");
  if (alive_ && !alive_->load())
    throw nb::value_error(
        "communicator: its run_threads block has ended; use a communicator only inside the "
        "function run_threads called");
  return *comm_;
}

void PyCommunicator::close() {
  std::shared_ptr<Communicator> owned = std::move(owned_);
  closed_ = true;
  comm_ = nullptr;
  nb::gil_scoped_release release;  // the transport's threads are joined without the GIL
  owned.reset();
}

namespace {

// A contiguous array's memory (for the collectives, which move raw bytes).
template <typename A>
void* contiguous_data(const A& a, const char* name) {
  if (a.device_type() != nb::device::cpu::value)
    throw nb::type_error(detail::concat(name, ": expected a CPU array").c_str());
  int64_t expect = 1;
  for (int i = static_cast<int>(a.ndim()) - 1; i >= 0; --i) {
    if (a.shape(i) > 1 && a.stride(i) != expect)
      throw nb::value_error(detail::concat(name, ": expected a contiguous array").c_str());
    expect *= static_cast<int64_t>(a.shape(i));
  }
  return const_cast<void*>(static_cast<const void*>(a.data()));
}

void allreduce(const PyCommunicator& self, const Array& a) {
  Communicator& comm = self.get();
  if (a.dtype() != nb::dtype<float>() && a.dtype() != nb::dtype<double>())
    throw nb::type_error("allreduce: expected a float32 or float64 array");
  void* data = contiguous_data(a, "allreduce");
  nb::gil_scoped_release release;
  if (a.dtype() == nb::dtype<float>())
    comm.allreduce(static_cast<float*>(data), a.size());
  else
    comm.allreduce(static_cast<double*>(data), a.size());
}

void allgather(const PyCommunicator& self, const nb::ndarray<nb::ro>& send, const Array& recv) {
  Communicator& comm = self.get();
  if (send.dtype() != recv.dtype())
    throw nb::type_error("allgather: send and recv must have one dtype");
  if (recv.nbytes() != send.nbytes() * static_cast<size_t>(comm.size()))
    throw nb::value_error(detail::concat("allgather: recv must hold size() * send = ", comm.size(),
                                         " x ", send.nbytes(), " bytes, got ", recv.nbytes())
                              .c_str());
  const void* s = contiguous_data(send, "allgather send");
  void* r = contiguous_data(recv, "allgather recv");
  const size_t bytes = send.nbytes();
  nb::gil_scoped_release release;
  comm.allgather(s, r, bytes);
}

// Note [A rank thread's Python state]: each rank runs on a thread of the library's, which has no
// Python state until it takes the GIL (PyGILState_Ensure makes one, counter 1). Left to
// PyGILState_Release, the state is cleared after its counter has dropped to 0, so an object
// whose deallocation takes the GIL itself (a torch tensor view in a threading.local: pybind11's
// gil_scoped_acquire inside torch) counts 0 -> 1 -> 0 and deletes the thread's state under the
// clear (SIGSEGV in tstate_delete_common). As CPython's own threads do, the state is cleared
// while the counter still holds it, then released.
class RankThreadGil {
 public:
  RankThreadGil()
      : fresh_(PyGILState_GetThisThreadState() == nullptr), state_(PyGILState_Ensure()) {}
  ~RankThreadGil() {
    if (fresh_) PyThreadState_Clear(PyThreadState_Get());
    PyGILState_Release(state_);
  }
  RankThreadGil(const RankThreadGil&) = delete;
  RankThreadGil& operator=(const RankThreadGil&) = delete;

 private:
  bool fresh_;
  PyGILState_STATE state_;
};

// Runs fn(comm) on `ranks` threads. A Python exception on a rank makes every other rank's
// communication fail promptly (run_threads' rule); the first one raised is re-raised here, so
// an assertion in a test reads as itself.
void run_threads_py(int ranks, nb::callable fn, double timeout_s) {
  if (ranks < 1) throw nb::value_error(detail::concat("ranks: must be >= 1, got ", ranks).c_str());
  std::mutex mu;
  std::optional<nb::python_error> first;
  LaunchOptions options;
  options.threads.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  std::string failure;
  {
    nb::gil_scoped_release release;
    try {
      launch(
          TransportKind::threads, ranks,
          [&](Communicator& comm) {
            auto alive = std::make_shared<std::atomic<bool>>(true);
            RankThreadGil gil;
            try {
              fn(PyCommunicator(&comm, alive));
              alive->store(false);
            } catch (nb::python_error& e) {
              alive->store(false);
              std::string what = e.what();
              {
                std::lock_guard lock(mu);
                if (!first) first.emplace(std::move(e));
              }
              throw Error(what);
            } catch (...) {
              alive->store(false);
              throw;
            }
          },
          options);
    } catch (const Error& e) {
      failure = e.what();
    }
  }
  if (first) throw std::move(*first);
  if (!failure.empty()) throw Error(failure);
}

}  // namespace

void bind_communicator(nb::module_& m) {
  nb::class_<PyCommunicator>(m, "Communicator",
                             "P ranks that exchange messages (one rank's handle).")
      .def_prop_ro("rank", [](const PyCommunicator& c) { return c.get().rank(); })
      .def_prop_ro("size", [](const PyCommunicator& c) { return c.get().size(); })
      .def_prop_ro("transport",
                   [](const PyCommunicator& c) { return transport_name(c.get().transport()); })
      // Seconds one wait may block; checked, and exposed as the property timeout_s, in Python
      // (ctxpar/__init__.py).
      .def("_timeout_s",
           [](const PyCommunicator& c) {
             return std::chrono::duration<double>(c.get().timeout()).count();
           })
      .def("_set_timeout_s",
           [](const PyCommunicator& c, double seconds) {
             c.get().set_timeout(std::chrono::milliseconds(
                 std::max<int64_t>(1, static_cast<int64_t>(seconds * 1000))));
           })
      .def("close", &PyCommunicator::close,
           "Lets go of this communicator now (a gloo one: its threads joined, its sockets "
           "closed); any later use raises ValueError. Not collective; idempotent.")
      .def_prop_ro("closed", [](const PyCommunicator& c) { return c.closed(); })
      .def("barrier",
           [](const PyCommunicator& c) {
             Communicator& comm = c.get();
             nb::gil_scoped_release release;
             comm.barrier();
           })
      .def(
          "split",
          [](const PyCommunicator& c, int color, int key) {
            Communicator& comm = c.get();
            if (color < 0)
              throw nb::value_error(
                  detail::concat("color: must be >= 0 (ranks of one color form a group), got ",
                                 color)
                      .c_str());
            std::unique_ptr<Communicator> part;
            {
              nb::gil_scoped_release release;
              part = comm.split(color, key);
            }
            return PyCommunicator(std::shared_ptr<Communicator>(std::move(part)), c.alive());
          },
          nb::arg("color"), nb::arg("key") = 0,
          "Collective: the ranks of one color (>= 0) form a new communicator, ordered by key "
          "(ties: this rank order). It inherits timeout_s.")
      .def("allreduce", &allreduce, nb::arg("array"),
           "Sums a contiguous float32/float64 array over the ranks, in place (rank order, "
           "deterministic).")
      .def("allgather", &allgather, nb::arg("send"), nb::arg("recv"),
           "recv (size x send's bytes, contiguous) receives every rank's send in rank order.")
      .def_static(
          "from_mpi4py",
          [](nb::handle comm) {
            // mpi4py hands out the address of its MPI_Comm handle; mpi_wrap duplicates it.
            nb::object mpi = nb::module_::import_("mpi4py.MPI");
            const auto address = nb::cast<uintptr_t>(mpi.attr("_addressof")(comm));
            return nb::module_::import_("ctxpar._ctxpar").attr("_mpi_wrap")(address);
          },
          nb::arg("comm"),
          "Wraps an mpi4py communicator (e.g. MPI.COMM_WORLD); ctxpar talks on a duplicate.");
  m.def("launched_by_mpi", &launched_by_mpi);
  // (name, ranks) of a launcher that started several copies without MPI (torchrun, srun);
  // ("", 0) when there is none or MPI started us.
  m.def("_foreign_launcher", [] {
    ForeignLauncher f = foreign_launcher();
    return std::make_pair(f.name, f.ranks);
  });
  m.def("run_threads", &run_threads_py, nb::arg("ranks"), nb::arg("fn"),
        nb::arg("timeout_s") = 120.0,
        "Runs fn(comm) on `ranks` threads of this process, one rank each, and returns when all "
        "have returned. An exception on one rank fails the others' communication promptly and is "
        "re-raised here.");
}

}  // namespace ctxpar::python

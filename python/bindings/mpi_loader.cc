// Loads the MPI plugin (mpi_plugin.h) the first time MPI is asked for: ctxpar._mpi_world,
// Communicator.from_mpi4py. Where it cannot be loaded (OpenMPI's libmpi.so.40 absent, or a
// ctxpar built without MPI) the call raises RuntimeError naming the library and the ways on;
// nothing else of the package needs it.
#include <dlfcn.h>
#include <sys/stat.h>

#include <mutex>
#include <string>

#include <nanobind/stl/string.h>

#include "communicator.h"
#include "mpi_plugin.h"

namespace ctxpar::python {

namespace {

constexpr const char* kPluginFile = "libctxpar_mpi.so";
constexpr const char* kWaysOn =
    "; or run without MPI: under torchrun (ctxpar.init() joins the job over gloo; "
    "Communicator.from_torch / from_mesh), or ctxpar.run_threads(ranks, fn) in one process";

std::mutex g_mu;
const MpiPlugin* g_plugin = nullptr;
std::string g_failure;  // why it could not be loaded (set once)

// The folder of this extension module: the plugin is installed next to it.
std::string module_dir() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<const void*>(&module_dir), &info) == 0 || !info.dli_fname) return ".";
  std::string path = info.dli_fname;
  const auto slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

// The plugin, or nullptr with g_failure saying why.
const MpiPlugin* load_locked() {
  if (g_plugin || !g_failure.empty()) return g_plugin;
  const std::string path = module_dir() + "/" + kPluginFile;
  struct stat st {};
  if (stat(path.c_str(), &st) != 0) {
    g_failure = "MPI transport: this ctxpar was built without MPI (" + path +
                " is absent: OpenMPI's development files were not found when it was built); "
                "install OpenMPI (Debian: apt install libopenmpi-dev) and reinstall ctxpar" +
                kWaysOn;
    return nullptr;
  }
  // RTLD_GLOBAL, as mpi4py loads libmpi: OpenMPI's own components, which it opens later, look
  // for libmpi's symbols there. The plugin exports only ctxpar_mpi_plugin.
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL);
  if (!handle) {
    const char* why = dlerror();
    g_failure = std::string("MPI transport: cannot load ") + path + ", which needs OpenMPI's " +
                "libmpi.so.40 (" + (why ? why : "dlopen failed") +
                "); install OpenMPI (Debian: apt install libopenmpi3 openmpi-bin; conda: "
                "openmpi) and start the job with mpirun" +
                kWaysOn;
    return nullptr;
  }
  using Entry = const MpiPlugin* (*)(int, SetTileProgressHook);
  auto entry = reinterpret_cast<Entry>(dlsym(handle, "ctxpar_mpi_plugin"));
  const MpiPlugin* plugin = entry ? entry(kMpiPluginAbi, &set_tile_progress_hook) : nullptr;
  if (!plugin) {
    g_failure = "MPI transport: " + path +
                " does not belong to this ctxpar (another build); reinstall ctxpar";
    return nullptr;
  }
  g_plugin = plugin;
  return g_plugin;
}

const MpiPlugin& plugin() {
  std::lock_guard lock(g_mu);
  if (const MpiPlugin* p = load_locked()) return *p;
  throw std::runtime_error(g_failure);
}

}  // namespace

void bind_mpi(nb::module_& m) {
  m.def("_mpi_world", [] { return PyCommunicator(&plugin().world(), nullptr); });
  m.def("_mpi_wrap", [](uintptr_t address) {
    std::shared_ptr<Communicator> c = plugin().wrap(reinterpret_cast<const void*>(address));
    return PyCommunicator(std::move(c));
  });
  // "" when the MPI transport can be loaded (it then is), else the reason _mpi_world raises.
  m.def("_mpi_unavailable", [] {
    std::lock_guard lock(g_mu);
    return load_locked() ? std::string() : g_failure;
  });
  // MPI_Abort of the whole job (nothing when the plugin is not loaded: MPI is then not
  // initialised): the uncaught-exception hook of ctxpar/_distributed.py.
  m.def("_abort_mpi_job", [](int code) {
    const MpiPlugin* p = nullptr;
    {
      std::lock_guard lock(g_mu);
      p = g_plugin;
    }
    if (!p) return;
    nb::gil_scoped_release release;
    p->abort_job(code);
  });
}

}  // namespace ctxpar::python

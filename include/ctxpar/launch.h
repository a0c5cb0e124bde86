// Starting a job's ranks, on any transport: launch(kind, ranks, fn) runs fn on each rank this
// process holds -- P threads (threads), or this process's rank of the mpirun job (mpi) or of
// the torchrun job over gloo (gloo). The commands' attention, train and decode, and the Python
// package's run_threads, start their ranks through it. See docs/comm.md ("Transports as a
// type, and launching a job").
#pragma once
#include <functional>

#include "ctxpar/comm.h"
#include "ctxpar/gloo.h"

namespace ctxpar {

// The transport that carries `kind`'s ranks: itself for threads, mpi and gloo; the launcher's
// (mpi under mpirun, else gloo) for nccl, threads for loopback.
TransportKind host_transport(TransportKind kind);

// Started by torchrun: its four variables, or the two of a partial environment that
// foreign_launcher() reads (joining the job then names the variable that is missing).
bool torchrun_job();

// The transport of the launcher that started this process (`--transport auto`): mpi under
// mpirun, gloo in a torchrun_job(), else threads.
TransportKind launcher_transport();

struct LaunchOptions {
  ThreadsOptions threads;  // threads: the simulated link and the timeout
  GlooOptions gloo;        // gloo: how this process joins the torchrun job (gloo_world)
};

// This torchrun job's gloo communicator, gloo_from_torchrun_env(options), made on the first
// call and kept until the process exits (its sockets close then); later calls return it,
// whatever their options.
Communicator& gloo_world(const GlooOptions& options = {});

// Runs fn on the ranks of host_transport(kind) that this process holds, and returns when they
// have returned:
//   threads  on `ranks` threads (run_threads: a rank that throws fails the others' next
//            communication; its error is rethrown here)
//   mpi      on this process's rank of mpi_world() (run_mpi: a rank that throws ends the job)
//   gloo     on this process's rank of gloo_world(options.gloo) (run_gloo: likewise)
// Under a launcher `ranks` must be its number of processes (else ctxpar::Error naming both,
// before fn runs). The nccl and loopback communicators are made over the rank's host
// communicator by fn itself (src/cuda: nccl_over, LoopbackComm).
void launch(TransportKind kind, int ranks, const std::function<void(Communicator&)>& fn,
            const LaunchOptions& options = {});

}  // namespace ctxpar

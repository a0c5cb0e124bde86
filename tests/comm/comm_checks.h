// Checks of every communicator operation that run on any transport: the threads tests call
// them inside run_threads, the MPI test program on mpi_world() (same code, so the two
// transports are held to the same expectations). Each check builds every rank's input from
// (rank, index, salt), so every rank can compute the expected answer on its own.
#pragma once
#include <cstddef>
#include <vector>

#include "ctxpar/comm.h"

namespace ctxpar::testing {

// A float in [-2^10, 2^10) of varied magnitude (so summation order changes the rounding).
float input_value(int rank, size_t i, int salt);

void check_point_to_point(Communicator& comm);  // ring exchange, FIFO per tag, self-send
void check_allgather(Communicator& comm, size_t bytes);
void check_reduce_scatter(Communicator& comm, size_t count);
void check_alltoall(Communicator& comm, size_t bytes);
void check_allreduce(Communicator& comm, size_t count);  // float and double
void check_barrier(Communicator& comm);
void check_split_mesh(Communicator& comm);  // data x context mesh, and ordering by key
void check_all(Communicator& comm);         // every check above, a few sizes each

// The outputs of reduce_scatter and allreduce (fp32 and fp64) on fixed inputs, as bytes, so
// two transports can be compared bit for bit.
std::vector<unsigned char> reduction_results(Communicator& comm);

}  // namespace ctxpar::testing

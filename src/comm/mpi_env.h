// The environment variables the MPI transport reads (CTXPAR_MPI_INIT_TIMEOUT,
// CTXPAR_MPI_PROGRESS, CTXPAR_MPI_PROGRESS_US), checked without starting MPI: the CLI calls
// this first, so a bad value is a usage error (exit 2) named at once on every rank.
// Built with CTXPAR_HAVE_MPI only.
#pragma once

namespace ctxpar {

// Throws ctxpar::Error naming the first bad variable and the values it accepts.
void check_mpi_environment();

}  // namespace ctxpar

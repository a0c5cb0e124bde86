"""ctxpar: context-parallel exact attention (ring, allgather, Ulysses, hybrid) for NumPy and
PyTorch. Tensors cross into C++ through DLPack without copies. See docs/python.md.

    out, lse = ctxpar.attention(q, k, v, ranks=4, strategy="ring", layout="zigzag",
                                mask="causal")
    dq, dk, dv = ctxpar.attention_backward(q, k, v, out, lse, dout, ranks=4, ...)
"""
import sys

from . import _checks
from . import _ctxpar
from ._ctxpar import Communicator, Error, __version__, launched_by_mpi
from ._attention import attention, attention_backward
from . import layout


def _get_timeout_s(self):
    return self._timeout_s()


def _set_timeout_s(self, seconds):
    self._set_timeout_s(_checks.timeout_s(seconds))


# Seconds one wait for a message may block before the rank fails (default 120).
Communicator.timeout_s = property(_get_timeout_s, _set_timeout_s,
                                  doc="Seconds one wait may block before the rank fails "
                                      f"(default 120; [{_checks.MIN_TIMEOUT:g}, "
                                      f"{_checks.MAX_TIMEOUT:g}]).")


def _abort_job_on_uncaught_exception(rank):
    """Under mpirun, a Python exception that ends this rank ends the whole job (MPI_Abort)
    after the traceback is printed, naming the rank: otherwise the interpreter's exit would
    wait in MPI_Finalize while its peers wait for its messages until their timeout."""
    previous = sys.excepthook
    if getattr(previous, "_ctxpar_rank", None) is not None:
        return

    def hook(kind, value, traceback):
        previous(kind, value, traceback)
        sys.stderr.write(f"ctxpar: rank {rank} failed: {kind.__name__}: {value}; ending every "
                         "rank of the mpirun job (MPI_Abort)\n")
        sys.stderr.flush()
        _ctxpar._abort_mpi_job(1)

    hook._ctxpar_rank = rank
    sys.excepthook = hook


def init(timeout_s=None):
    """The world communicator of an `mpirun` job (initialises MPI once; MPI_Finalize at exit).

    timeout_s: seconds one wait may block before the rank fails (default 120; also
    comm.timeout_s). An uncaught Python exception on a rank then ends the whole job at once,
    naming the rank (MPI_Abort). Without mpirun this is a world of one rank."""
    timeout = None if timeout_s is None else _checks.timeout_s(timeout_s)
    comm = _ctxpar._mpi_world()
    if timeout is not None:
        comm.timeout_s = timeout
    if comm.transport == "mpi":
        _abort_job_on_uncaught_exception(comm.rank)
    return comm


def _from_mpi4py(comm, timeout_s=None):
    """Wraps an mpi4py communicator (e.g. MPI.COMM_WORLD); ctxpar talks on a duplicate.
    timeout_s and the uncaught-exception rule as in ctxpar.init()."""
    timeout = None if timeout_s is None else _checks.timeout_s(timeout_s)
    c = _from_mpi4py_binding(comm)
    if timeout is not None:
        c.timeout_s = timeout
    from mpi4py import MPI
    _abort_job_on_uncaught_exception(MPI.COMM_WORLD.Get_rank())
    return c


_from_mpi4py_binding = Communicator.from_mpi4py
Communicator.from_mpi4py = staticmethod(_from_mpi4py)


def run_threads(ranks, fn, timeout_s=120.0):
    """Runs fn(comm) on `ranks` threads of this process, one rank each, and returns when all
    have returned. An exception on one rank fails the others' communication promptly and is
    re-raised here. timeout_s: seconds one wait may block."""
    if not callable(fn):
        raise TypeError(f"fn: expected a callable taking the communicator, got "
                        f"{type(fn).__name__}")
    return _ctxpar.run_threads(_checks.ranks(ranks), fn, _checks.timeout_s(timeout_s))


__all__ = ["Communicator", "Error", "__version__", "attention", "attention_backward", "init",
           "launched_by_mpi", "layout", "run_threads"]

"""ctxpar: context-parallel exact attention (ring, allgather, Ulysses, hybrid) for NumPy and
PyTorch. Tensors cross into C++ through DLPack without copies. See docs/python.md.

    out, lse = ctxpar.attention(q, k, v, ranks=4, strategy="ring", layout="zigzag",
                                mask="causal")
    dq, dk, dv = ctxpar.attention_backward(q, k, v, out, lse, dout, ranks=4, ...)
"""
from . import _checks
from . import _ctxpar
from . import _distributed
from ._ctxpar import Communicator, Error, __version__, launched_by_mpi
from ._attention import attention, attention_backward, document_ids_from_cu_seqlens
from .inference import KVCache
from . import layout
from . import testing


def _get_timeout_s(self):
    return self._timeout_s()


def _set_timeout_s(self, seconds):
    self._set_timeout_s(_checks.timeout_s(seconds))


# Seconds one wait for a message may block before the rank fails (default 120).
Communicator.timeout_s = property(_get_timeout_s, _set_timeout_s,
                                  doc="Seconds one wait may block before the rank fails "
                                      f"(default 120; [{_checks.MIN_TIMEOUT:g}, "
                                      f"{_checks.MAX_TIMEOUT:g}]).")


def init(timeout_s=None):
    """The world communicator of the launcher's job, joined the launcher's way:
    under mpirun MPI_COMM_WORLD (MPI initialised once, finalised at exit); under torchrun
    (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) every worker of the job over ctxpar's gloo
    transport (or, once torch.distributed is initialised, its default group); without a
    launcher a world of one rank (over MPI where it loads, else over gloo). Where it cannot join the job it saw (srun without an MPI
    plugin, a torchrun job without its variables) it raises RuntimeError naming the launcher
    and what to do: it never returns a world of one inside a job of several. MPI is loaded only
    here (under mpirun, or without a launcher) and in Communicator.from_mpi4py; where OpenMPI's
    libmpi.so.40 is absent under mpirun it raises RuntimeError naming it and the ways on.

    timeout_s: seconds one wait may block before the rank fails (default 120; also
    comm.timeout_s). An uncaught Python exception on a rank then ends the whole job at once,
    naming the rank (mpirun: MPI_Abort; torchrun: the process exits, torchrun stops the rest)."""
    timeout = None if timeout_s is None else _checks.timeout_s(timeout_s)
    comm = _distributed.init_from_launcher(timeout)
    if comm is not None:
        return comm
    if not _ctxpar.launched_by_mpi() and _ctxpar._mpi_unavailable():
        # No launcher and no MPI: a world of one without it.
        return _distributed.world_of_one(timeout)
    comm = _ctxpar._mpi_world()  # RuntimeError naming libmpi.so.40 where MPI cannot load
    if timeout is not None:
        comm.timeout_s = timeout
    if comm.transport == "mpi":
        _distributed.exit_on_uncaught_exception(comm.rank, "mpirun")
    return comm


def _from_mpi4py(comm, timeout_s=None):
    """Wraps an mpi4py communicator (e.g. MPI.COMM_WORLD); ctxpar talks on a duplicate.
    timeout_s and the uncaught-exception rule as in ctxpar.init()."""
    timeout = None if timeout_s is None else _checks.timeout_s(timeout_s)
    c = _from_mpi4py_binding(comm)
    if timeout is not None:
        c.timeout_s = timeout
    from mpi4py import MPI
    _distributed.exit_on_uncaught_exception(MPI.COMM_WORLD.Get_rank(), "mpirun")
    return c


_from_mpi4py_binding = Communicator.from_mpi4py
Communicator.from_mpi4py = staticmethod(_from_mpi4py)
Communicator.from_torch = staticmethod(_distributed.from_torch)
Communicator.from_mesh = staticmethod(_distributed.from_mesh)


def launched_by():
    """The launcher that started this process: "mpirun", "torchrun", "srun" (several tasks,
    no MPI plugin) or None. ctxpar.init() joins the first two' jobs and refuses the third."""
    return _distributed.launcher()[0]


def run_threads(ranks, fn, timeout_s=120.0):
    """Runs fn(comm) on `ranks` threads of this process, one rank each, and returns when all
    have returned. An exception on one rank fails the others' communication promptly and is
    re-raised here. timeout_s: seconds one wait may block."""
    if not callable(fn):
        raise TypeError(f"fn: expected a callable taking the communicator, got "
                        f"{type(fn).__name__}")
    return _ctxpar.run_threads(_checks.ranks(ranks), fn, _checks.timeout_s(timeout_s))


__all__ = ["Communicator", "Error", "KVCache", "__version__", "attention", "attention_backward", "init",
           "launched_by", "launched_by_mpi", "layout", "run_threads", "testing"]

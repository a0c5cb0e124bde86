"""ctxpar: context-parallel exact attention (ring, allgather, Ulysses, hybrid) for NumPy and
PyTorch. Tensors cross into C++ through DLPack without copies. See docs/python.md.

    out, lse = ctxpar.attention(q, k, v, ranks=4, strategy="ring", layout="zigzag",
                                mask="causal")
    dq, dk, dv = ctxpar.attention_backward(q, k, v, out, lse, dout, ranks=4, ...)
"""
from ._ctxpar import Communicator, Error, __version__, launched_by_mpi, run_threads
from ._attention import attention, attention_backward
from . import layout


def init():
    """The world communicator of an `mpirun` job (initialises MPI once; MPI_Finalize at exit).

    Without mpirun this is a world of one rank."""
    from ._ctxpar import _mpi_world
    return _mpi_world()


__all__ = ["Communicator", "Error", "__version__", "attention", "attention_backward", "init",
           "launched_by_mpi", "layout", "run_threads"]

"""ctxpar inside a launcher's job: which launcher started this process, the torchrun and
torch.distributed paths of ctxpar.init(), Communicator.from_torch / from_mesh, and the rule
that an uncaught exception on a rank ends the job at once (docs/python.md, "Launching").

Over a torch ProcessGroup, ctxpar builds its own gloo transport (C++, include/ctxpar/gloo.h):
each rank opens a listening address (GlooBootstrap), the addresses are exchanged once with
torch.distributed.all_gather_object on the group, and the ranks connect. After that no
transfer of ctxpar goes through Python or through torch's process group."""
import os
import sys
import time

from . import _checks
from . import _ctxpar

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launcher():
    """(kind, description) of the launcher that started this process: ("mpirun", "mpirun"),
    ("torchrun", "torchrun (WORLD_SIZE=2)"), ("srun", "srun (SLURM_STEP_NUM_TASKS=4)") or
    (None, ""). A launcher of one process (torchrun --nproc-per-node 1) is none: its world of
    one is right. The rules are the command's (src/comm/launcher.cc)."""
    if _ctxpar.launched_by_mpi():
        return "mpirun", "mpirun"
    name, ranks = _ctxpar._foreign_launcher()
    if ranks > 1:
        return name.split(" ")[0], name
    return None, ""


def gloo_available():
    """True when the extension has the library's gloo transport (built with libgloo-dev)."""
    return hasattr(_ctxpar, "_gloo_available") and _ctxpar._gloo_available()


def _need_gloo(what, fix):
    if not gloo_available():
        raise RuntimeError(f"{what}: this ctxpar was built without its gloo transport "
                           f"(include/ctxpar/gloo.h); {fix}")


def _torch_distributed_initialized():
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


_world = []  # ctxpar.init()'s communicator under torchrun, once made


def init_from_launcher(timeout):
    """ctxpar.init()'s communicator under torchrun / srun, or None where MPI (or no launcher)
    gives the world. Raises RuntimeError naming the launcher where no transport can join it."""
    kind, seen = launcher()
    if kind == "torchrun":
        if _world:  # the job's communicator is made once, as MPI's world
            if timeout is not None:
                _world[0].timeout_s = timeout
            return _world[0]
        if _torch_distributed_initialized():
            _world.append(from_torch(None, timeout))
            return _world[0]
        missing = [v for v in _TORCHRUN_VARS if v not in os.environ]
        if missing:
            raise RuntimeError(f"ctxpar.init: started by {seen}, but {', '.join(missing)} "
                               f"{'is' if len(missing) == 1 else 'are'} "
                               "not set, so the ranks cannot find each other; start the job "
                               "with torchrun (it sets RANK, WORLD_SIZE, MASTER_ADDR, "
                               "MASTER_PORT), or call torch.distributed.init_process_group() "
                               "and ctxpar.Communicator.from_torch()")
        _need_gloo("ctxpar.init", f"it cannot join the job it was started in ({seen}): "
                   "rebuild ctxpar with gloo, or run the job under mpirun")
        comm = _ctxpar._gloo_from_torchrun_env(_timeout_ms(timeout))
        _keep(comm)
        exit_on_uncaught_exception(comm.rank, "torchrun")
        _world.append(comm)
        return comm
    if kind == "srun":
        raise RuntimeError(f"ctxpar.init: started by {seen} without an MPI plugin: every task "
                           "would run as a world of one; start the job with `srun --mpi=pmix` (ctxpar then uses "
                           "MPI) or under torchrun")
    return None


def world_of_one(timeout):
    """ctxpar.init()'s world of one rank where MPI cannot be loaded (no launcher): a gloo
    communicator of one rank, or the MPI error where the extension has no gloo either."""
    if not gloo_available():
        return _ctxpar._mpi_world()  # raises, naming libmpi.so.40 and the ways on
    bootstrap = _ctxpar._GlooBootstrap(0, 1, _timeout_ms(timeout))
    return bootstrap.connect([bootstrap.address()], _timeout_ms(timeout))


def _timeout_ms(timeout):
    return int(round(1000 * (120.0 if timeout is None else timeout)))


def from_torch(group=None, timeout_s=None):
    """A ctxpar communicator over exactly the ranks of a torch ProcessGroup (gloo or NCCL;
    None: the default group), ranks numbered as in the group. Collective over the group when
    it is made; made once per group and reused, as from_mesh (timeout_s: seconds one wait may
    block, default 120, set when it is made, or set anew on the one reused). The communicator
    of a group torch has destroyed since is closed at the next call (Note [Closing at exit])."""
    timeout = None if timeout_s is None else _checks.timeout_s(timeout_s)
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("Communicator.from_torch: torch.distributed is not initialised; call "
                           "torch.distributed.init_process_group() first (under torchrun: "
                           "init_process_group('gloo') or 'nccl')")
    _close_destroyed_groups(dist)
    key = group if group is not None else dist.group.WORLD
    cached = _by_group.get(id(key))
    if cached is not None and cached[0] is key:
        comm = cached[1]
        if timeout is not None:
            comm.timeout_s = timeout
        return comm
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"group: this process (global rank {dist.get_rank()}) is not a member "
                         "of the group; call from_torch only on the group's ranks")
    size = dist.get_world_size(group)
    _need_gloo("Communicator.from_torch", "rebuild ctxpar with gloo")
    bootstrap = _ctxpar._GlooBootstrap(rank, size, _timeout_ms(timeout))
    addresses = [None] * size
    dist.all_gather_object(addresses, bootstrap.address(), group=group)
    comm = bootstrap.connect(addresses, _timeout_ms(timeout))
    _keep(comm)
    if key is not None:  # (None: a stand-in for torch in the tests, without a group object)
        _by_group[id(key)] = (key, comm)
    exit_on_uncaught_exception(dist.get_rank(), "mpirun" if _ctxpar.launched_by_mpi() else
                               _launcher_name())
    return comm


# One communicator per process group: a block entered every step must not reconnect. The group
# itself is kept, so that its id cannot be reused by another group.
_by_group = {}

# Note [Closing at exit]
# A gloo communicator owns threads (Gloo's event loop, the abort listener) and sockets. Left to
# the interpreter's finalisation it goes whenever its last reference does: during module
# teardown, in an order nobody chose, while torch's process group and the peers' processes go
# too (issue 38: `terminate called without an active exception` at exit). So every
# communicator ctxpar makes for a launcher's job (from_torch, from_mesh, init under torchrun) is
# recorded here and closed by an atexit hook, which runs before the interpreter finalises and
# before torch's own hooks (atexit runs hooks in reverse order of registration; ours is
# registered after `import torch`). Closing joins its threads with the GIL released; a handle
# used after that raises ValueError. A group that torch has destroyed is closed at the next
# from_torch.
_made = []


def _keep(comm):
    if not _made:
        import atexit
        atexit.register(close_all)
    _made.append(comm)


def close_all():
    """Closes every communicator ctxpar made for the job (the atexit hook)."""
    _by_group.clear()
    _world.clear()
    while _made:
        _made.pop().close()


def _close_destroyed_groups(dist):
    live = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_map", None)
    if live is None:
        return
    for key, (group, comm) in list(_by_group.items()):
        if group not in live:
            del _by_group[key]
            comm.close()


def from_mesh(mesh, mesh_dim=None, timeout_s=None):
    """The ctxpar communicator over one dimension of a torch DeviceMesh (a name such as "cp" or
    an index; None for a 1-D mesh): this rank's group along that dimension, made once per group
    and reused (from_torch's cache; timeout_s as there)."""
    if mesh_dim is None and mesh.ndim != 1:
        names = getattr(mesh, "mesh_dim_names", None)
        raise ValueError(f"mesh: a {mesh.ndim}-D DeviceMesh (dims {names}); name the context-"
                         "parallel dimension (from_mesh(mesh, 'cp')) or pass mesh['cp']")
    group = mesh.get_group(mesh_dim) if mesh_dim is not None else mesh.get_group()
    return from_torch(group, timeout_s)


def _launcher_name():
    kind, _ = launcher()
    return kind or "launcher"


def exit_on_uncaught_exception(rank, launcher_name):
    """An uncaught Python exception on this rank prints its traceback, then a line naming the
    rank, and ends the process at once (exit 1): under mpirun by MPI_Abort of the whole job;
    under torchrun by leaving, which makes torchrun stop every other worker. Without it the
    interpreter's exit may wait for peers (MPI_Finalize, transport threads) while they wait for
    this rank's messages until their timeout."""
    previous = sys.excepthook
    if getattr(previous, "_ctxpar_rank", None) is not None:
        return

    def hook(kind, value, traceback):
        previous(kind, value, traceback)
        if launcher_name == "mpirun":
            sys.stderr.write(f"ctxpar: rank {rank} failed: {kind.__name__}: {value}; ending "
                             "every rank of the mpirun job (MPI_Abort)\n")
            sys.stderr.flush()
            _ctxpar._abort_mpi_job(1)  # returns where MPI is not initialised (a world of one)
            return
        sys.stderr.write(f"ctxpar: rank {rank} failed: {kind.__name__}: {value}; exiting so "
                         f"that {launcher_name} ends the other ranks\n")
        sys.stderr.flush()
        sys.stdout.flush()
        stopped_by = _stopped_by()
        _write_error_file(kind, value, traceback, rank if stopped_by is None else stopped_by)
        if stopped_by is not None and os.environ.get("TORCHELASTIC_RUN_ID"):
            time.sleep(_STOPPED_RANK_GRACE_S)  # Note [The error file names the rank ...]
        os._exit(1)

    hook._ctxpar_rank = rank
    sys.excepthook = hook


# Note [The error file names the rank that failed first]
# torchrun's elastic agent names as root cause the failure with the earliest timestamp, in
# whole seconds, ties to the lowest rank, and reads each worker's message from the file at
# TORCHELASTIC_ERROR_FILE (which torch's @record decorator writes). A rank stopped by another
# rank's failure (its peer's abort message, or its connection closed) fails too, often within
# the same second, and then the agent names rank 0 whichever rank failed (the issue saw it;
# where the agent ended rank 0 first it named the right rank, with error_file <N/A> and no
# message). So each failing rank writes its error file (torch's format;
# extraInfo.first_failed_rank names the rank that failed first), and under the agent a stopped
# rank waits before it exits: the agent, which polls every 0.1 s by default, sees the first
# failure alone and ends the others (SIGTERM), which it does not count as failures.
_STOPPED_RANK_GRACE_S = 5.0


def _stopped_by():
    """The rank (of a communicator ctxpar made) whose failure this process heard of, other than
    its own; None when there is none."""
    for comm in _made:
        if not comm.closed:
            failed = _ctxpar._gloo_failed_rank(comm)
            if failed >= 0 and failed != comm.rank:
                return failed
    return None


def _write_error_file(kind, value, tb, first):
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    import json
    import traceback
    message = f"{kind.__name__}: {value}"
    data = {"message": {"message": message, "extraInfo": {
        "py_callstack": "".join(traceback.format_exception(kind, value, tb)),
        "timestamp": str(int(time.time())), "first_failed_rank": str(first)}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError as e:
        sys.stderr.write(f"ctxpar: could not write the error file {path} "
                         f"(TORCHELASTIC_ERROR_FILE): {e}\n")

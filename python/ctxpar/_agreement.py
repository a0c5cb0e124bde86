"""Ranks agree on a call's arguments before they communicate (the command's rank agreement,
tools/ctxpar/rank_agreement.cc): each rank's (name, value) list is allgathered, and every rank
raises the same ValueError naming the first argument that differs and both values. Without it
a rank with another layout (say) computes rows that are silently wrong by O(1)."""
import hashlib

import numpy as np


def digest(a):
    """A short fingerprint of an integer array (positions, document ids), or "(not given)"."""
    if a is None:
        return "(not given)"
    return f"{a.size} ints, sha1 {hashlib.sha1(np.ascontiguousarray(a).tobytes()).hexdigest()[:16]}"


def _serialize(signature):
    # \x1f and \x1e: separators no argument text holds (names, numbers, mask texts).
    return "".join(f"{n}\x1f{v}\x1e" for n, v in signature).encode()


def _parse(text):
    entries = [e for e in text.rstrip(b"\0").decode(errors="replace").split("\x1e") if e]
    return dict(e.split("\x1f", 1) for e in entries if "\x1f" in e)


def agree(comm, what, signature):
    """Collective: every rank of comm calls it with its own [(name, value text), ...]."""
    P = comm.size
    if P == 1:
        return
    mine = _serialize(signature)
    lengths = np.empty(P, np.int64)
    comm.allgather(np.array([len(mine)], np.int64), lengths)
    longest = int(lengths.max())
    send = np.zeros(longest, np.uint8)
    send[:len(mine)] = np.frombuffer(mine, np.uint8)
    gathered = np.empty((P, longest), np.uint8)
    comm.allgather(send, gathered)
    theirs = [_parse(gathered[r].tobytes()) for r in range(P)]
    for name, _ in signature:
        for r in range(1, P):
            a = theirs[0].get(name, "(unknown)")
            b = theirs[r].get(name, "(unknown)")
            if a != b:
                raise ValueError(f"{what}: the ranks were called with different arguments: {name} "
                                 f"is {a} on rank 0 but {b} on rank {r}; every rank of the "
                                 "communicator must pass the same")

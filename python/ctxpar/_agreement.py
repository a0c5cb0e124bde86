"""Ranks agree on a call's arguments before they communicate: the library's agreement
(include/ctxpar/agreement.h, the one the strategies and the command use). Each rank's
(name, value) list is compared across the ranks, and every rank raises the same ValueError
naming the first argument that differs and both values. Without it a rank with another layout
(say) computes rows that are silently wrong by O(1)."""
import hashlib

import numpy as np

from . import _ctxpar


def digest(a):
    """A short fingerprint of an integer array (positions, document ids), or "(not given)"."""
    if a is None:
        return "(not given)"
    return f"{a.size} ints, sha1 {hashlib.sha1(np.ascontiguousarray(a).tobytes()).hexdigest()[:16]}"


def agree(comm, what, signature):
    """Collective: every rank of comm calls it with its own [(name, value text), ...]."""
    _ctxpar._require_agreement(comm, what, [(str(n), str(v)) for n, v in signature])

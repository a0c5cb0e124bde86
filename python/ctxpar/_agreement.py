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


def agree(comm, what, signature, local_error=None):
    """Collective: every rank of comm calls it with its own [(name, value text), ...].
    local_error: this rank's refusal of its own arguments (an exception), so that the other
    ranks raise too instead of waiting for it; it is raised here as itself."""
    try:
        _ctxpar._require_agreement(comm, what, [(str(n), str(v)) for n, v in signature],
                                   "" if local_error is None else str(local_error))
    except ValueError:
        if local_error is not None:
            raise local_error from None
        raise


def agree_after(comm, what, check, signature):
    """Collective: check() (this rank's checks of its own arguments, returning what they made),
    then the ranks agree on signature(that). A rank whose check refuses raises its refusal as
    itself and the others a ValueError naming that rank: none waits for a rank that left."""
    try:
        made = check()
    except (TypeError, ValueError) as e:
        agree(comm, what, [], e)
        raise  # not reached: agree raises e itself
    agree(comm, what, signature(made))
    return made

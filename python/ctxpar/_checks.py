"""Every number and name of the Python API is checked here, before it reaches the extension:
the same ranges as the command's options (docs/cli.md, "Number ranges"), and an error that
names the argument, the value and what is accepted (never nanobind's "Invoked with types", a
wrapped integer or a clamped number). See docs/python.md, "Argument checks"."""
import math
import numbers

from . import _ctxpar

# The library's ranges, which the command's options use too (include/ctxpar/limits.h, comm.h
# kMaxThreadsRanks, strategy.h kMaxUlyssesGroups), read from the extension: one home.
_LIMITS = _ctxpar._limits
MAX_THREADS = _LIMITS["threads"]              # threads: OpenMP threads per rank (--threads)
MAX_THREADS_RANKS = _LIMITS["threads_ranks"]  # ranks as threads of this process (--ranks)
MAX_PROCESSES = _LIMITS["processes"]          # ulysses_degree (--ulysses-degree)
MAX_TOKENS = _LIMITS["tokens"]                # tokens (--seq)
MAX_HEADS = _LIMITS["heads"]                  # head_groups (a count of kv heads, --heads' range)
MAX_BATCH = _LIMITS["batch"]                  # KVCache sequences (--batch)
MIN_TIMEOUT, MAX_TIMEOUT = _LIMITS["min_timeout"], _LIMITS["max_timeout"]  # timeout_s (--timeout)
THREADS_RANKS_NOTE = ("every rank is a thread of this process and the per-pair state grows as "
                      "ranks^2; for more ranks run one process per rank under mpirun")

STRATEGIES = ("ring", "allgather", "ulysses", "hybrid")
LAYOUTS = ("contiguous", "zigzag", "striped", "balanced")
# KernelConfig::bf16_tier (docs/kernel.md, "bf16 tiers"): exact (the default) or fast (P and dS
# rounded to bf16, as GPU flash attention); float32 inputs ignore it.
BF16_TIERS = ("exact", "fast")


def whole(name, value, lo, hi, note=""):
    """A whole number in [lo, hi] (bool refused: True is not a thread count)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        if isinstance(value, numbers.Real) and not isinstance(value, bool) and \
                math.isfinite(value) and float(value).is_integer():
            value = int(value)
        else:
            raise TypeError(f"{name}: expected a whole number in [{lo}, {hi}], got {value!r} "
                            f"({type(value).__name__})")
    value = int(value)
    if not lo <= value <= hi:
        raise ValueError(f"{name}: must be in [{lo}, {hi}]{' (' + note + ')' if note else ''}, "
                         f"got {value}")
    return value


def real(name, value, lo, hi):
    """A finite number in [lo, hi]."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a number in [{lo:g}, {hi:g}], got {value!r} "
                        f"({type(value).__name__})")
    value = float(value)
    if not (math.isfinite(value) and lo <= value <= hi):
        raise ValueError(f"{name}: must be a finite number in [{lo:g}, {hi:g}], got {value!r}")
    return value


def choice(name, value, choices):
    if not isinstance(value, str):
        raise TypeError(f"{name}: expected one of {', '.join(choices)} (a string), got {value!r}")
    if value not in choices:
        raise ValueError(f"{name}: expected one of {', '.join(choices)}, got {value!r}")
    return value


def threads(value):
    return whole("threads", value, 1, MAX_THREADS)


def bf16_tier(value):
    return choice("bf16_tier", value, BF16_TIERS)


def ranks(value):
    return whole("ranks", value, 1, MAX_THREADS_RANKS, THREADS_RANKS_NOTE)


def timeout_s(value):
    return real("timeout_s", value, MIN_TIMEOUT, MAX_TIMEOUT)


def scale(value):
    """None (1/sqrt(D)) or a positive, finite float32. The library reads a scale of 0 as "not
    given" (include/ctxpar/kernel.h) and refuses negative ones, so 0.0, or a number that rounds
    to 0 or to infinity in float32, would silently become another scale."""
    if value is None:
        return 0.0  # the library's "1/sqrt(D)"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"scale: expected None (1/sqrt(D)) or a positive finite number, got "
                        f"{value!r} ({type(value).__name__})")
    import numpy as np
    value = float(value)
    with np.errstate(over="ignore", under="ignore"):
        as32 = float(np.float32(value))
    if not math.isfinite(value) or not math.isfinite(as32):
        raise ValueError(f"scale: must be finite (and fit float32, scale <= 3.4e38), got "
                         f"{value!r}")
    if value < 0:
        raise ValueError(f"scale: must be positive, got {value!r}")
    if as32 == 0.0:
        what = "0" if value == 0.0 else f"{value!r}, 0 in float32,"
        raise ValueError(f"scale: {what} is not a usable softmax scale (every score would be "
                         "0: uniform attention); pass scale=None for 1/sqrt(D), or a positive "
                         "number")
    return as32

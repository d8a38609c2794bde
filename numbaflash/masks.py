"""Causal masking: the two alignments, in one place.

Both alignments say "query row r may attend to key column c iff c <= r + offset"; they
differ only in the offset when Sq != Sk:

    bottom_right (flash-attention's convention, and what ``causal=True`` means here):
        offset = Sk - Sq. The last query row sees every key; with Sq > Sk the first
        Sq - Sk rows see no key at all (fully masked rows: output 0, lse -inf).
    top_left (PyTorch SDPA's ``is_causal=True``):
        offset = 0. The first query row sees key 0 only.

For Sq == Sk both are the usual lower-triangular mask.
"""

import numpy as np

CAUSAL_MODES = ("bottom_right", "top_left")


def parse_causal(causal):
    """Normalise the user's ``causal`` argument to None, "bottom_right" or "top_left".

    Accepts False/None (no mask), True (= "bottom_right"), or one of the mode names.
    Raises ValueError for anything else.
    """
    if causal is None or causal is False:
        return None
    if causal is True:
        return "bottom_right"
    if isinstance(causal, str) and causal in CAUSAL_MODES:
        return causal
    raise ValueError(
        f"causal must be False, True, 'bottom_right' or 'top_left'; got {causal!r}"
    )


def causal_offset(Sq, Sk, mode):
    """Column offset of the diagonal: key c is visible from query r iff c <= r + offset."""
    if mode is None:
        return Sk  # every column is visible (c < Sk <= r + Sk)
    if mode == "bottom_right":
        return Sk - Sq
    if mode == "top_left":
        return 0
    raise ValueError(f"unknown causal mode {mode!r}")


def visible(Sq, Sk, causal):
    """Boolean (Sq, Sk) matrix: True where query row r may attend to key column c."""
    mode = parse_causal(causal)
    rows = np.arange(Sq)[:, None]
    cols = np.arange(Sk)[None, :]
    return cols <= rows + causal_offset(Sq, Sk, mode)


# ---------------------------------------------------------------------------------------
# Sliding windows (flash-attention's ``window_size=(left, right)``)
#
# Query row r sees key column c iff  r + Sk - Sq - left <= c <= r + Sk - Sq + right,
# both bounds inclusive and aligned bottom-right as in flash-attention; -1 means "no bound
# on that side". causal=True is the window (-1, 0). Every mask of this module is a band
# between two diagonals:
#
#     lower_offset <= c - r <= upper_offset
#
# with either side possibly unbounded (None). The kernels take the two offsets at run
# time (``causal_offset`` is the upper one, ``window_lo`` the lower one) and whether each
# side exists at compile time.


def parse_window(window_size):
    """Normalise ``window_size`` to None (no window) or a pair of ints (left, right), each
    >= -1 (-1: unbounded on that side). (-1, -1) is no window. Raises ValueError."""
    if window_size is None:
        return None
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise ValueError(f"window_size must be None or a pair of ints (left, right); got "
                         f"{window_size!r}") from None
    for x in (left, right):
        if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < -1:
            raise ValueError(f"window_size must be a pair of ints >= -1 (left, right), -1 "
                             f"meaning unbounded on that side; got {window_size!r}")
    left, right = int(left), int(right)
    return None if (left, right) == (-1, -1) else (left, right)


def band(Sq, Sk, causal=None, window_size=None):
    """``(upper, lower)``: key c is visible from query r iff lower <= c - r <= upper, where
    None means no bound on that side. Combines ``causal`` (either alignment) and
    ``window_size`` (bottom-right aligned, flash-attention's convention)."""
    mode = parse_causal(causal)
    window = parse_window(window_size)
    upper = None if mode is None else causal_offset(Sq, Sk, mode)
    lower = None
    if window is not None:
        left, right = window
        if right >= 0:
            w_upper = Sk - Sq + right
            upper = w_upper if upper is None else min(upper, w_upper)
        if left >= 0:
            lower = Sk - Sq - left
    return upper, lower


def visible_band(Sq, Sk, causal=None, window_size=None):
    """Boolean (Sq, Sk): True where query row r may attend to key column c (causal and
    window together)."""
    upper, lower = band(Sq, Sk, causal, window_size)
    diff = np.arange(Sk)[None, :] - np.arange(Sq)[:, None]
    ok = np.ones((Sq, Sk), bool)
    if upper is not None:
        ok &= diff <= upper
    if lower is not None:
        ok &= diff >= lower
    return ok

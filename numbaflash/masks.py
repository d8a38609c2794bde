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

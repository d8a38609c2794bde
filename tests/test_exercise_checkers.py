"""Each notebook exercise's checker accepts the solution and rejects plausible mistakes.

Notebooks 01 to 05 end with an exercise and a checking function defined in the notebook
(``check_my_attention``, ``check_online_step``, ``check_tile_step``, ``check_lse_kernel``,
``check_dS``). tests/test_notebooks.py runs each notebook, and so each checker on
``notebooks/solutions.py``; that shows a checker accepts a right answer, not that it can
reject a wrong one. Here each checker is taken from its notebook's source (the setup cell,
then the checker's cell without the call on the learner's empty stub) and fed the solution
(it must say it matches) and the mistakes learners make (each must raise AssertionError,
and the message must name the mistake where the checker recognises it).

Runs on the simulator (NUMBA_ENABLE_CUDASIM=1) or a GPU: the 04 checker launches kernels.
"""

import ast
import math
import sys
from pathlib import Path

import jupytext
import numpy as np
import pytest
from numba import cuda

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
sys.path.insert(0, str(NOTEBOOKS))
import solutions  # noqa: E402  (notebooks/solutions.py, as the notebooks import it)


def load_checker(stem, name):
    """The function ``name`` as notebook ``stem`` defines it: its first code cell (imports,
    sizes, rng) is run, then the code cell that defines ``name``, without that cell's
    top-level calls (the call on the learner's stub)."""
    cells = [c.source for c in jupytext.read(NOTEBOOKS / f"{stem}.py").cells
             if c.cell_type == "code"]
    namespace = {"__name__": f"notebook_{stem}"}
    exec(compile(cells[0], f"{stem}.py, first code cell", "exec"), namespace)
    cell = next(c for c in cells if f"def {name}(" in c)
    tree = ast.parse(cell)
    tree.body = [node for node in tree.body if not isinstance(node, ast.Expr)]
    exec(compile(tree, f"{stem}.py, the cell of {name}", "exec"), namespace)
    return namespace[name]


@pytest.fixture(scope="module")
def checkers():
    return {
        "01": load_checker("01_standard_attention", "check_my_attention"),
        "02": load_checker("02_online_softmax", "check_online_step"),
        "03": load_checker("03_tiling_in_numpy", "check_tile_step"),
        "04": load_checker("04_forward_kernel", "check_lse_kernel"),
        "05": load_checker("05_backward", "check_dS"),
    }


def not_written(*args):
    raise NotImplementedError


# --- which checker, its solution, and the words it prints when the answer is right --------

SOLUTIONS = {
    "01": (solutions.my_attention, "all cases match"),
    "02": (solutions.my_online_step, "every intermediate (m, l) matches"),
    "03": (solutions.my_tile_step, "O and L match"),
    "04": (solutions.my_lse_kernel, "my_lse_kernel matches"),
    "05": (solutions.my_dS, "dS matches"),
}


SEEDS = range(4)


def with_seed(checker, seed):
    """The checker with its notebook's ``rng`` reset: a checker draws its cases from the
    notebook's generator, so what it sees depends on what ran before. A wrong answer must
    be rejected whatever the draw, and the solution accepted."""
    checker.__globals__["rng"] = np.random.default_rng(seed)
    return checker


@pytest.mark.parametrize("nb", sorted(SOLUTIONS))
def test_the_solution_passes(checkers, capsys, nb):
    solution, words = SOLUTIONS[nb]
    for seed in SEEDS:
        with_seed(checkers[nb], seed)(solution)
        assert words in capsys.readouterr().out, f"seed {seed}"


@pytest.mark.parametrize("nb, stub", [("01", not_written), ("02", not_written),
                                      ("03", not_written), ("04", None), ("05", not_written)])
def test_an_unwritten_exercise_is_reported_not_failed(checkers, capsys, nb, stub):
    checkers[nb](stub)                  # the learner's cell before they write anything
    out = capsys.readouterr().out
    assert ("not attempted yet" if stub else "skipped") in out
    assert SOLUTIONS[nb][1] not in out


# --- 01: standard attention -------------------------------------------------------------

def softmax_rows(S):
    E = np.exp(S - S.max(axis=1, keepdims=True))
    return E / E.sum(axis=1, keepdims=True)


def attention_no_scale(Q, K, V):
    return softmax_rows(Q @ K.T) @ V


def attention_no_max(Q, K, V):
    E = np.exp(Q @ K.T / np.sqrt(Q.shape[1]))
    return (E / E.sum(axis=1, keepdims=True)) @ V


def attention_columns(Q, K, V):
    S = Q @ K.T / np.sqrt(Q.shape[1])
    E = np.exp(S - S.max(axis=0, keepdims=True))
    return (E / E.sum(axis=0, keepdims=True)) @ V


def attention_transposed(Q, K, V):
    return solutions.my_attention(Q, K, V).T


def attention_scale_by_keys(Q, K, V):
    return softmax_rows(Q @ K.T / np.sqrt(K.shape[0])) @ V


def attention_last_key_dropped(Q, K, V):
    return softmax_rows(Q @ K[:-1].T / np.sqrt(Q.shape[1])) @ V[:-1]


def attention_column_max(Q, K, V):
    S = Q @ K.T / np.sqrt(Q.shape[1])
    E = np.exp(S - S.max(axis=0, keepdims=True))       # the max of each column, not row
    return (E / E.sum(axis=1, keepdims=True)) @ V


def attention_global_max(Q, K, V):
    S = Q @ K.T / np.sqrt(Q.shape[1])
    E = np.exp(S - S.max())                 # one max for all rows: a row far below it underflows
    return (E / E.sum(axis=1, keepdims=True)) @ V


# --- 02: one step of the online softmax ---------------------------------------------------

def step_no_rescale(m, l, xb):
    m_new = max(m, np.max(xb))
    if m_new == -np.inf:
        return m, l
    return m_new, l + np.exp(xb - m_new).sum()


def step_upside_down(m, l, xb):
    m_new = max(m, np.max(xb))
    if m_new == -np.inf:
        return m, l
    return m_new, l * np.exp(m_new - m) + np.exp(xb - m_new).sum()


def step_old_max(m, l, xb):
    m_new = max(m, np.max(xb))
    if m_new == -np.inf:
        return m, l
    return m_new, l * np.exp(m - m_new) + np.exp(xb - m).sum()


def step_no_max(m, l, xb):
    return max(m, np.max(xb)), l + np.exp(xb).sum()


def step_unguarded(m, l, xb):                       # the solution without its -inf guard
    m_new = max(m, np.max(xb))
    return m_new, l * np.exp(m - m_new) + np.exp(xb - m_new).sum()


def step_block_max_only(m, l, xb):                  # forgets the running max
    m_new = np.max(xb)
    if m_new == -np.inf:
        return m, l
    return m_new, l * np.exp(m - m_new) + np.exp(xb - m_new).sum()


def step_max_not_returned(m, l, xb):
    m_new = max(m, np.max(xb))
    if m_new == -np.inf:
        return m, l
    return m, l * np.exp(m - m_new) + np.exp(xb - m_new).sum()


def step_last_entry_as_max(m, l, xb):       # the block's last entry, not its max
    m_new = max(m, xb[-1])
    if m_new == -np.inf:
        return m, l
    return m_new, l * np.exp(m - m_new) + np.exp(xb - m_new).sum()


# --- 03: Algorithm 1 lines 8 to 10 --------------------------------------------------------

def tile_no_scale(Qi, Kj, Vj, m_i, l_i, o_i, softmax_scale):
    return solutions.my_tile_step(Qi, Kj, Vj, m_i, l_i, o_i, 1.0)


def tile_o_not_rescaled(Qi, Kj, Vj, m_i, l_i, o_i, softmax_scale):
    Sij = Qi @ Kj.T * softmax_scale
    m_new = np.maximum(m_i, Sij.max(axis=1))
    Pij = np.exp(Sij - m_new[:, None])
    alpha = np.exp(m_i - m_new)
    return m_new, alpha * l_i + Pij.sum(axis=1), o_i + Pij @ Vj


def tile_l_not_rescaled(Qi, Kj, Vj, m_i, l_i, o_i, softmax_scale):
    Sij = Qi @ Kj.T * softmax_scale
    m_new = np.maximum(m_i, Sij.max(axis=1))
    Pij = np.exp(Sij - m_new[:, None])
    alpha = np.exp(m_i - m_new)
    return m_new, l_i + Pij.sum(axis=1), alpha[:, None] * o_i + Pij @ Vj


def tile_old_max(Qi, Kj, Vj, m_i, l_i, o_i, softmax_scale):
    Sij = Qi @ Kj.T * softmax_scale
    m_new = np.maximum(m_i, Sij.max(axis=1))
    Pij = np.exp(Sij - m_i[:, None])                 # the old max: exp(S + inf) at first
    alpha = np.exp(m_i - m_new)
    return m_new, alpha * l_i + Pij.sum(axis=1), alpha[:, None] * o_i + Pij @ Vj


def tile_max_of_this_tile(Qi, Kj, Vj, m_i, l_i, o_i, softmax_scale):
    Sij = Qi @ Kj.T * softmax_scale
    m_new = Sij.max(axis=1)                          # not max(m_i, ...): no running max
    Pij = np.exp(Sij - m_new[:, None])
    alpha = np.exp(m_i - m_new)
    return m_new, alpha * l_i + Pij.sum(axis=1), alpha[:, None] * o_i + Pij @ Vj


def tile_alpha_upside_down(Qi, Kj, Vj, m_i, l_i, o_i, softmax_scale):
    Sij = Qi @ Kj.T * softmax_scale
    m_new = np.maximum(m_i, Sij.max(axis=1))
    Pij = np.exp(Sij - m_new[:, None])
    alpha = np.exp(np.where(np.isinf(m_i), 0.0, m_new - m_i))
    return m_new, alpha * l_i + Pij.sum(axis=1), alpha[:, None] * o_i + Pij @ Vj


def tile_one_max_per_tile(Qi, Kj, Vj, m_i, l_i, o_i, softmax_scale):
    Sij = Qi @ Kj.T * softmax_scale
    m_new = np.maximum(m_i, Sij.max())      # the tile's max, not each row's: rows underflow
    Pij = np.exp(Sij - m_new[:, None])
    alpha = np.exp(m_i - m_new)
    return m_new, alpha * l_i + Pij.sum(axis=1), alpha[:, None] * o_i + Pij @ Vj


# --- 04: the logsumexp kernel -------------------------------------------------------------

@cuda.jit
def lse_no_guard(Q, K, L, softmax_scale):
    bh = cuda.blockIdx.y
    row = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    m = -math.inf
    l = 0.0
    for c in range(K.shape[1]):
        s = 0.0
        for kk in range(Q.shape[2]):
            s += Q[bh, row, kk] * K[bh, c, kk]
        s *= softmax_scale
        m_new = max(m, s)
        l = l * math.exp(m - m_new) + math.exp(s - m_new)
        m = m_new
    L[bh, row] = m + math.log(l)


@cuda.jit
def lse_guard_off_by_one(Q, K, L, softmax_scale):
    bh = cuda.blockIdx.y
    row = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if row > Q.shape[1]:                    # lets row == Q.shape[1] through
        return
    m = -math.inf
    l = 0.0
    for c in range(K.shape[1]):
        s = 0.0
        for kk in range(Q.shape[2]):
            s += Q[bh, row, kk] * K[bh, c, kk]
        s *= softmax_scale
        m_new = max(m, s)
        l = l * math.exp(m - m_new) + math.exp(s - m_new)
        m = m_new
    L[bh, row] = m + math.log(l)


@cuda.jit
def lse_no_scale(Q, K, L, softmax_scale):
    bh = cuda.blockIdx.y
    row = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if row >= Q.shape[1]:
        return
    m = -math.inf
    l = 0.0
    for c in range(K.shape[1]):
        s = 0.0
        for kk in range(Q.shape[2]):
            s += Q[bh, row, kk] * K[bh, c, kk]
        m_new = max(m, s)
        l = l * math.exp(m - m_new) + math.exp(s - m_new)
        m = m_new
    L[bh, row] = m + math.log(l)


@cuda.jit
def lse_no_max(Q, K, L, softmax_scale):
    bh = cuda.blockIdx.y
    row = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if row >= Q.shape[1]:
        return
    l = 0.0
    for c in range(K.shape[1]):
        s = 0.0
        for kk in range(Q.shape[2]):
            s += Q[bh, row, kk] * K[bh, c, kk]
        l += math.exp(s * softmax_scale)
    L[bh, row] = math.log(l)


@cuda.jit
def lse_head_zero(Q, K, L, softmax_scale):
    bh = 0                                  # forgets blockIdx.y: every block does head 0
    row = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if row >= Q.shape[1]:
        return
    m = -math.inf
    l = 0.0
    for c in range(K.shape[1]):
        s = 0.0
        for kk in range(Q.shape[2]):
            s += Q[bh, row, kk] * K[bh, c, kk]
        s *= softmax_scale
        m_new = max(m, s)
        l = l * math.exp(m - m_new) + math.exp(s - m_new)
        m = m_new
    L[bh, row] = m + math.log(l)


@cuda.jit
def lse_last_key_dropped(Q, K, L, softmax_scale):
    bh = cuda.blockIdx.y
    row = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if row >= Q.shape[1]:
        return
    m = -math.inf
    l = 0.0
    for c in range(K.shape[1] - 1):
        s = 0.0
        for kk in range(Q.shape[2]):
            s += Q[bh, row, kk] * K[bh, c, kk]
        s *= softmax_scale
        m_new = max(m, s)
        l = l * math.exp(m - m_new) + math.exp(s - m_new)
        m = m_new
    L[bh, row] = m + math.log(l) if l > 0 else -math.inf


@cuda.jit
def lse_not_rescaled(Q, K, L, softmax_scale):
    bh = cuda.blockIdx.y
    row = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if row >= Q.shape[1]:
        return
    m = -math.inf
    l = 0.0
    for c in range(K.shape[1]):
        s = 0.0
        for kk in range(Q.shape[2]):
            s += Q[bh, row, kk] * K[bh, c, kk]
        s *= softmax_scale
        m_new = max(m, s)
        l = l + math.exp(s - m_new)         # the old sum not multiplied by exp(m - m_new)
        m = m_new
    L[bh, row] = m + math.log(l)


# --- 05: D and dS -------------------------------------------------------------------------

def dS_without_D(P, V, dO, O):
    return P * (dO @ V.T)


def dS_sign_flipped(P, V, dO, O):
    return P * (np.sum(dO * O, axis=1)[:, None] - dO @ V.T)


def dS_D_from_dP(P, V, dO, O):
    dP = dO @ V.T
    return P * (dP - dP.sum(axis=1, keepdims=True))


def dS_without_P(P, V, dO, O):
    return dO @ V.T - np.sum(dO * O, axis=1)[:, None]


def dS_transposed(P, V, dO, O):
    return solutions.my_dS(P, V, dO, O).T


def dS_scaled(P, V, dO, O):                 # the scale belongs to dQ and dK, not dS
    return solutions.my_dS(P, V, dO, O) / np.sqrt(V.shape[1])


WRONG = [
    # notebook, wrong answer, what the checker's message must say (None: any diagnosis)
    ("01", attention_no_scale, "without the scale"),
    ("01", attention_no_max, "inf or NaN"),
    ("01", attention_columns, "normalises the columns"),
    ("01", attention_transposed, "shape"),
    ("01", attention_scale_by_keys, None),
    ("01", attention_last_key_dropped, None),
    ("01", attention_column_max, None),
    ("01", attention_global_max, "inf or NaN"),
    ("02", step_no_rescale, "not rescaled"),
    ("02", step_upside_down, "upside down"),
    ("02", step_old_max, None),
    ("02", step_no_max, None),
    ("02", step_unguarded, "Return the state unchanged"),
    ("02", step_block_max_only, "the new max is"),
    ("02", step_max_not_returned, "the new max is"),
    ("02", step_last_entry_as_max, "the new max is"),
    ("03", tile_no_scale, "without softmax_scale"),
    ("03", tile_o_not_rescaled, "L is right but O is wrong"),
    ("03", tile_l_not_rescaled, "L is wrong with several tiles"),
    ("03", tile_old_max, "inf or NaN"),
    ("03", tile_max_of_this_tile, None),
    ("03", tile_alpha_upside_down, None),
    ("03", tile_one_max_per_tile, "inf or NaN"),
    ("04", lse_no_guard, "out-of-bounds"),
    ("04", lse_guard_off_by_one, "out-of-bounds"),
    ("04", lse_no_scale, "without softmax_scale"),
    ("04", lse_no_max, None),
    ("04", lse_head_zero, "NaN in"),
    ("04", lse_last_key_dropped, None),
    ("04", lse_not_rescaled, None),
    ("05", dS_without_D, "D is missing"),
    ("05", dS_sign_flipped, "sign is flipped"),
    ("05", dS_D_from_dP, "D is rowsum(dP)"),
    ("05", dS_without_P, "factor P is missing"),
    ("05", dS_transposed, "shape"),
    ("05", dS_scaled, None),
]


def name_of(fn):
    """A function's name; a kernel's is its Python function's."""
    return getattr(fn, "__name__", None) or getattr(fn, "py_func", fn).__name__


@pytest.mark.parametrize("nb, wrong, says", WRONG,
                         ids=[f"{nb}-{name_of(w)}" for nb, w, _ in WRONG])
def test_a_wrong_answer_is_rejected(checkers, capsys, nb, wrong, says):
    for seed in SEEDS:
        with pytest.raises(AssertionError) as excinfo:
            with_seed(checkers[nb], seed)(wrong)
        if says is not None:
            assert says in str(excinfo.value), (
                f"seed {seed}: the checker rejected {name_of(wrong)} but did not name the "
                f"mistake ({says!r}); it said: {excinfo.value}")
        assert SOLUTIONS[nb][1] not in capsys.readouterr().out

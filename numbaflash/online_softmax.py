"""The online softmax on its own: one pass over a row, a running max and a running sum.

softmax(x)_c = exp(x_c - m) / l with m = max(x) and l = sum_c exp(x_c - m). The usual
code needs two passes over x (one for m, one for l). The online version keeps, after
seeing x_0..x_t,

    m_t = max(m_{t-1}, x_t)
    l_t = l_{t-1} * exp(m_{t-1} - m_t) + exp(x_t - m_t)

so that l_t = sum_{c<=t} exp(x_c - m_t) at every step: when the max grows, the old sum is
rescaled by exp(m_old - m_new) <= 1. Nothing ever overflows, because every exponent is
<= 0. FlashAttention applies the same rescaling to the output accumulator o, and works a
block of columns at a time instead of one (``block`` below).

m starts at -inf and l at 0; exp(-inf - m) = 0, but (-inf) - (-inf) is NaN, so a row
that has seen only masked (-inf) entries keeps m = -inf and l = 0 without computing it.
"""

import numpy as np


def online_softmax_steps(x, block=1):
    """Yield the running state ``(t, m, l)`` after each block of ``block`` entries of x.

    ``t`` is the number of entries seen so far. Step through it in a notebook:

        for t, m, l in online_softmax_steps([1.0, 3.0, 2.0]):
            print(t, m, l)
    """
    x = np.asarray(x, dtype=np.float64)
    m, l = -np.inf, 0.0
    for start in range(0, x.size, block):
        xb = x[start:start + block]
        m_new = max(m, xb.max())                       # running max after this block
        if m_new == -np.inf:                            # only masked entries so far
            yield start + xb.size, m, l
            continue
        alpha = np.exp(m - m_new)                       # rescale what we had: exp(m_old - m_new)
        l = l * alpha + np.exp(xb - m_new).sum()        # add this block's terms
        m = m_new
        yield start + xb.size, m, l


def online_softmax(x, block=1):
    """softmax(x) computed from the online statistics; equals the two-pass softmax.

    Returns ``(p, m, l)``: the probabilities, the max and the sum (logsumexp = m + log l).
    An all -inf row gives p = 0, m = -inf, l = 0.
    """
    x = np.asarray(x, dtype=np.float64)
    m, l = -np.inf, 0.0
    for _, m, l in online_softmax_steps(x, block):
        pass
    if l == 0:
        return np.zeros_like(x), m, l
    return np.exp(x - m) / l, m, l


def naive_softmax(x):
    """softmax without subtracting the max: exp(x) / sum(exp(x)). Overflows for x > ~709
    in float64 (~88 in float32); here to show why the max is subtracted."""
    x = np.asarray(x)
    with np.errstate(over="ignore", invalid="ignore"):
        e = np.exp(x)
        return e / e.sum()

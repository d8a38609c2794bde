"""L0 (NumPy): the building blocks of the split-KV decode kernel
(numbaflash/kernels/decode/split_kv.py), apart from the kernel.

The simulator's stand-in of its 8-byte loads (``ptx.flat_load_wide``): the bits of the
elements, and a fault where a GPU's vector load would fault.
"""

import numpy as np
import pytest


def test_the_simulators_wide_load_faults_where_a_gpu_would():
    """flat_load_wide's stand-in reads 8 bytes as the elements of A, bit for bit, and
    raises on an address that is not 8-byte aligned (a GPU's vector load faults there)."""
    from numbaflash.kernels import simulated
    a = np.arange(16, dtype=np.float16)
    assert simulated.flat_load_wide(a, 4) == (4.0, 5.0, 6.0, 7.0)
    b = np.arange(8, dtype=np.float32)
    assert simulated.flat_load_wide(b, 6) == (6.0, 7.0)
    with pytest.raises(ValueError, match="misaligned"):
        simulated.flat_load_wide(a, 2)
    with pytest.raises(ValueError, match="misaligned"):
        simulated.flat_load_wide(b[1:], 0)

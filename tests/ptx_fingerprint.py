"""The PTX fingerprint tests/test_ptx.py compares against tests/ptx_fingerprints.json.

Kept apart from ptx_check.py (which needs the real compiler) so that the simulator's test
process can check the fingerprint itself.
"""

import hashlib
import re

# Mangled names (module path, function, a hash of its closure), and the names Numba gives
# shared and local arrays (_cudapy_smem_N: N counts every array the process has compiled,
# so it depends on what was compiled before)
NAME_RE = re.compile(r"_Z\w+?(?=_param_\d+\b|\b)|_cudapy_[a-z]+_\d+\b")


def normalised_ptx(ptx):
    """The PTX with what a move of code may change taken out: every mangled name (it
    spells the module path and a hash of the closure's arguments) and every generated
    array name becomes F0, F1, ... in order of first appearance, and the compiler's
    comment header is dropped."""
    names = {}
    body = "\n".join(ln for ln in ptx.splitlines() if not ln.startswith("//"))
    return NAME_RE.sub(lambda m: names.setdefault(m.group(0), f"F{len(names)}"), body)


def fingerprint(ptx):
    """16 hex digits of the SHA-256 of ``normalised_ptx(ptx)``."""
    return hashlib.sha256(normalised_ptx(ptx).encode()).hexdigest()[:16]

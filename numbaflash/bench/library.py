"""What the bench takes from the rest of numbaflash, imported here and nowhere else.

The other modules of ``numbaflash.bench`` import these names from this module, so a move
inside the library (the public API, the dispatcher, the kernels) changes one line here.
"""

from .. import masks, reference  # noqa: F401
from ..api import attention, attention_backward, explain, explain_backward  # noqa: F401
from ..kvcache import attention_with_kvcache, explain_kvcache  # noqa: F401
from ..policy import backend, plan_backward  # noqa: F401
from ..varlen import (attention_varlen, attention_varlen_backward,  # noqa: F401
                      check_varlen_inputs, explain_varlen)
from ..kernels import simulating  # noqa: F401
from ..kernels.forward import VERSIONS as FORWARD_VERSIONS  # noqa: F401


def version():
    """numbaflash's version string, read at call time (``numbaflash/__init__.py`` sets
    ``__version__`` after its own imports)."""
    from .. import __version__
    return __version__

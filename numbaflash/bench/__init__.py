"""Benchmark numbaflash against PyTorch SDPA (``python -m numbaflash bench``).

``runner`` holds the benchmark; this package exports its names.
"""

from .runner import *  # noqa: F401,F403
from .runner import (  # noqa: F401 - used by scripts
    _agreement, _json_safe, _tf32_off, _torch_cuda, attention, attention_backward)

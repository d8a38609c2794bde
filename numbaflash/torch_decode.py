"""Repeated decoding calls on CUDA tensors, launched directly: the fast path of
numbaflash.torch's ``flash_attn_with_kvcache``.

A decoding loop calls ``flash_attn_with_kvcache`` once per generated token with the same
shapes and options; only the pointers (q, the new k and v, the outputs) and the lengths
change. The whole path (numbaflash.attention_with_kvcache: the checks, the plan, a Numba
view of every tensor, the buffers, up to three launches) costs the host more than the
kernels take at the shapes decoding runs (docs/performance.md, "The group on the tensor
cores, and the call around the kernel"). So the first call of each kind records the
kernels it launched (``kvcache.recording``), and later calls of that kind launch the same
compiled kernels again (launcher._DirectLaunch.launch_words) with their own pointers, on
PyTorch's current stream, into outputs from PyTorch's allocator.

A kind (``decode_key``) is everything the checks and the plan depend on: the shapes,
strides and dtype of q, the caches and the new k and v; where the caches start modulo 16
bytes (which loads the kernels may use); the device; the options; and whether the
lengths are a tensor (its shape, strides and dtype) or an int (then also how many splits
the planner may choose for it: ``policy.split_limit``). An int length is still checked
on every call (0 <= n and n + S_new <= S_max); one out of range takes the whole path,
which raises. Calls with ``alibi_slopes`` (an array of the caller's) take the whole path
every time.

The direct path is also what lets a decoding step be captured in a CUDA graph: it
allocates through PyTorch (inside ``torch.cuda.graph`` that is the graph's memory pool)
and launches on PyTorch's current stream, the capturing one. A kind's first call must
run outside the capture, as PyTorch asks of any captured code (a warm-up). An int length
is written into a tensor by the captured step (``torch.full``), so a replay uses the
value of the capture: a loop that advances the lengths passes them as a tensor and
updates it in place.
"""

import torch

from . import kvcache, policy

_FAST = {}                  # decode_key -> FastDecode
_FAST_MAX = 256


def decode_key(q, k_cache, v_cache, k, v, cache_seqlens, options):
    """The kind of a decoding call (module docstring), from the (batch, heads, seqlen, d)
    views the whole path is given; None for a call that is never repeated directly."""
    if options["alibi_slopes"] is not None or not q.is_cuda:
        return None
    if isinstance(cache_seqlens, torch.Tensor):
        lengths = (cache_seqlens.shape, cache_seqlens.stride(), cache_seqlens.dtype)
    elif isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        S_new = 0 if k is None else k.shape[2]
        lengths = ("int", policy.split_limit(cache_seqlens + S_new))
    else:
        return None
    try:
        key = (q.device, q.dtype,
               tuple((x.shape, x.stride(), x.data_ptr() % 16) if x is not None else None
                     for x in (q, k_cache, v_cache, k, v)),
               lengths, tuple(sorted(options.items())))
        hash(key)
    except TypeError:
        return None
    return key


class FastDecode:
    """One kind of decoding call, ready to launch again: for each kernel its first call
    launched, the launcher._DirectLaunch and its parameter words, those that depend on the
    call's arrays left as the names of the arrays whose pointers go there
    (``kvcache.Launched.roles``); the shapes of the outputs and scratch buffers."""

    def __init__(self, launched, device_index):
        self.device_index = device_index
        self.launches = []          # (direct, words between the pointers, their names)
        self.shapes = {}            # "out", "lse", "o_parts", "l_parts" -> shape
        self.dtypes = {}            # ... -> the NumPy dtype the kernels write
        for one in launched:
            chunks, names, words = [], [], []
            for make, arg, role in zip(one.direct.makers, one.args, one.roles):
                made = make(arg)
                if role is None:
                    words.extend(made)
                    continue
                words.extend(made[:4])          # launcher.array_words: the pointer is 5th
                chunks.append(tuple(words))
                names.append(role)
                words = list(made[5:])
                if role in ("out", "lse", "o_parts", "l_parts"):
                    self.shapes[role], self.dtypes[role] = tuple(arg.shape), arg.dtype
            chunks.append(tuple(words))
            self.launches.append((one.direct, tuple(chunks), tuple(names)))

    def ready(self, device_index):
        """Whether every kernel can be launched directly on this device."""
        return device_index == self.device_index and all(
            direct.ready(device_index) for direct, _, _ in self.launches)

    def __call__(self, q, k_cache, v_cache, k, v, cache_seqlens, stream):
        """(out, lse) tensors, (batch, Hq, Sq, d) and (batch, Hq, Sq), for (batch, heads,
        seqlen, d) views of this kind; None (nothing launched) if this call must take
        the whole path: another device, or an int length out of range."""
        device = q.device
        index = device.index
        if torch.cuda.current_device() != index or not self.ready(index):
            return None
        B, S_max = k_cache.shape[0], k_cache.shape[2]
        if isinstance(cache_seqlens, torch.Tensor):
            seqlens = cache_seqlens
        else:
            S_new = 0 if k is None else k.shape[2]
            if not 0 <= cache_seqlens <= S_max - S_new:
                return None
            seqlens = torch.full((B,), cache_seqlens, dtype=torch.int32, device=device)
        pointers = {"q": q.data_ptr(), "k_cache": k_cache.data_ptr(),
                    "v_cache": v_cache.data_ptr(), "seqlens": seqlens.data_ptr()}
        if k is not None:
            pointers["k"], pointers["v"] = k.data_ptr(), v.data_ptr()
        made = {}
        for role, shape in self.shapes.items():
            dtype = (q.dtype if role == "out" else
                     torch.float64 if self.dtypes[role].itemsize == 8 else torch.float32)
            made[role] = torch.empty(shape, dtype=dtype, device=device)
            pointers[role] = made[role].data_ptr()
        for direct, chunks, names in self.launches:
            words = list(chunks[0])
            for name, chunk in zip(names, chunks[1:]):
                words.append(pointers[name])
                words.extend(chunk)
            direct.launch_words(words, stream, index)
        B, Hq, Sq, d = q.shape
        return made["out"].view(B, Hq, Sq, d), made["lse"].view(B, Hq, Sq)


def remember(key, launched, device_index):
    """After a whole-path call of kind ``key`` that recorded ``launched``
    (kvcache.recording): keep what repeating it directly needs, if every kernel it
    launched was launched directly."""
    if not launched or any(one is None for one in launched):
        return
    fast = FastDecode(launched, device_index)
    if "out" not in fast.shapes or "lse" not in fast.shapes:
        return
    if len(_FAST) >= _FAST_MAX:
        _FAST.clear()
    _FAST[key] = fast


def lookup(key):
    """The FastDecode of a kind, or None."""
    return None if key is None else _FAST.get(key)

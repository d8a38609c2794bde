"""Repeated decoding calls on device arrays, launched directly.

A decoding loop calls ``attention_with_kvcache`` (or numbaflash.torch's
``flash_attn_with_kvcache``) once per generated token with the same shapes and options;
only the pointers (q, the new k and v, the outputs) and the lengths change. The whole
call (the checks, the plan, a Numba view of every input, the buffers, up to three
launches) costs the host more than the kernels take at the shapes decoding runs
(docs/performance.md, "Decoding"). So the first call of each kind records the kernels it
launched (``kvcache.recording``), and later calls of that kind launch the same compiled
kernels again with their own pointers, on the call's stream, into outputs from the
caller's allocator: each kernel's parameter words laid out once and only the pointers
written per call (launcher.PreparedLaunch; with ``launcher.PREPARED_LAUNCH = False``,
the words built anew for cuda.core's launch, launcher._DirectLaunch.launch_words).

A kind is everything the checks and the plan depend on; each caller builds its key
(``kvcache.direct_key`` for device arrays, ``numbaflash.torch`` for tensors): the
shapes, strides and dtype of q, the caches and the new k and v; where each starts modulo
16 bytes (which loads the kernels may use); the device; the options; and whether the
lengths are a device array (its shape, strides and dtype) or an int (then also how many
splits the planner may choose for it: ``policy.split_limit``). An int length is still
checked on every call (0 <= n and n + S_new <= S_max); one out of range takes the whole
path, which raises. Calls with ``alibi_slopes`` (an array of the caller's) take the
whole path every time.

The direct path is also what lets a decoding step be captured in a CUDA graph through
PyTorch: it allocates through PyTorch (inside ``torch.cuda.graph`` that is the graph's
memory pool) and launches on PyTorch's current stream, the capturing one.
"""

import math

from . import launcher, policy

_REMEMBERED = {}            # key -> FastDecode
_REMEMBERED_MAX = 256

# The arrays a decoding call makes for its kernels (kvcache.Launched.roles)
MADE = ("out", "lse", "o_parts", "l_parts")
# The role of an array argument the kernel does not touch in calls of its kind (the split
# kernel's out and lse when a combine follows it): its pointer is 0 in every launch.
UNUSED = "unused"
# The scratch a repeated call takes from its stream's workspace, in this order: the
# lengths (when given as an int), then the splits' partial results.
SCRATCH = ("seqlens", "o_parts", "l_parts")


class FastDecode:
    """One kind of decoding call, ready to launch again: for each kernel its first call
    launched, the launcher._DirectLaunch and its parameter words, those that depend on the
    call's arrays left as the names of the arrays whose pointers go there
    (``kvcache.Launched.roles``); the shapes and dtypes of the arrays it makes."""

    def __init__(self, launched, device_index):
        self.device_index = device_index
        self.launches = []          # (direct, words between the pointers, their names)
        self.made = {}              # "out", "lse", "o_parts", "l_parts" -> (shape, dtype)
        self.prepared = []          # per launch: its launcher.PreparedLaunch, once made
        self.batch = 0              # B, the length of the lengths array
        for one in launched:
            chunks, names, words = [], [], []
            for make, arg, role in zip(one.direct.makers, one.args, one.roles):
                words_of_arg = make(arg)
                if role is None:
                    words.extend(words_of_arg)
                    continue
                words.extend(words_of_arg[:4])      # launcher.array_words: the pointer is 5th
                if role == "seqlens":
                    self.batch = arg.shape[0]
                if role == UNUSED:
                    words.append(0)
                    words.extend(words_of_arg[5:])
                    continue
                chunks.append(tuple(words))
                names.append(role)
                words = list(words_of_arg[5:])
                if role in MADE:
                    self.made[role] = (tuple(arg.shape), arg.dtype)
            chunks.append(tuple(words))
            self.launches.append((one.direct, tuple(chunks), tuple(names)))
            self.prepared.append(None)
        # Per launch, the arrays to make just before it (those no earlier launch needed):
        # a call timed alone waits for what runs before its first kernel, so the outputs
        # of a call whose split kernel leaves them UNUSED are made while it runs.
        seen = set()
        self.make_before = []
        for _, _, names in self.launches:
            new = tuple(r for r in names if r in self.made and r not in seen)
            seen.update(new)
            self.make_before.append(new)
        # The scratch layout, by whether the lengths are the caller's device array.
        self.scratch = {on_device: self._scratch(not on_device) for on_device in (False, True)}

    def _scratch(self, with_lengths):
        """``(offsets, total bytes)`` of the scratch (SCRATCH) a call takes from its
        stream's workspace, each part 256-byte aligned; ``with_lengths``: the lengths
        are an int, written there (else the caller's device array is read)."""
        at, offsets = 0, {}
        for role in SCRATCH:
            if role == "seqlens":
                if not with_lengths:
                    continue
                nbytes = 4 * self.batch
            elif role in self.made:
                shape, dtype = self.made[role]
                nbytes = math.prod(shape) * dtype.itemsize
            else:
                continue
            offsets[role] = at
            at += -(-nbytes // 256) * 256
        return offsets, at

    def ready(self, device_index):
        """Whether every kernel can be launched directly on this device."""
        return device_index == self.device_index and all(
            direct.ready(device_index) for direct, _, _ in self.launches)

    def launch(self, pointers, allocate, stream):
        """Launch the kernels for a call of this kind: ``pointers`` maps "q", "k_cache",
        "v_cache", "seqlens" (and "k", "v" with new rows) to the call's device pointers;
        ``allocate(role, shape, dtype)`` returns ``(array, pointer)`` for each array the
        call makes (MADE). Returns {role: array}. The caller has checked ``ready``."""
        made = {}
        for i, (direct, chunks, names) in enumerate(self.launches):
            for role in self.make_before[i]:
                shape, dtype = self.made[role]
                made[role], pointers[role] = allocate(role, shape, dtype)
            if launcher.PREPARED_LAUNCH:
                prepared = self.prepared[i] or self._prepare(i)
                if prepared is not None:
                    prepared.launch([pointers[name] for name in names], stream.handle)
                    continue
            words = list(chunks[0])
            for name, chunk in zip(names, chunks[1:]):
                words.append(pointers[name])
                words.extend(chunk)
            direct.launch_words(words, stream, self.device_index)
        return made

    def _prepare(self, i):
        """Launch i's launcher.PreparedLaunch: its words laid out once, the pointers'
        positions set at each launch (None if its kernel cannot be launched that way)."""
        direct, chunks, names = self.launches[i]
        words, slots = list(chunks[0]), []
        for chunk in chunks[1:]:
            slots.append(len(words))
            words.append(0)                 # the pointer, set at each launch
            words.extend(chunk)
        self.prepared[i] = direct.prepare(words, slots, self.device_index)
        return self.prepared[i]


def remember(key, launched, device_index):
    """After a whole call of kind ``key`` that recorded ``launched`` (kvcache.recording):
    keep what repeating it directly needs, if every kernel it launched was launched
    directly (one through Numba's dispatcher leaves None in ``launched``)."""
    if key is None or not launched or any(one is None for one in launched):
        return
    fast = FastDecode(launched, device_index)
    if "out" not in fast.made or "lse" not in fast.made:
        return
    if len(_REMEMBERED) >= _REMEMBERED_MAX:
        _REMEMBERED.clear()
    _REMEMBERED[key] = fast


def lookup(key):
    """The FastDecode of a kind, or None."""
    return None if key is None else _REMEMBERED.get(key)


def forget():
    """Forget every kind (the next call of each takes the whole path)."""
    _REMEMBERED.clear()


def int_lengths_key(cache_seqlens, S_new):
    """The part of a key for lengths given as an int: the planner's split limit for it
    (``policy.split_limit``); None if cache_seqlens is not a Python int."""
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        return ("int", policy.split_limit(cache_seqlens + S_new))
    return None

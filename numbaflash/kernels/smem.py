"""Dynamic shared memory above 48 KB: the one driver call numba-cuda does not make.

A kernel that declares ``cuda.shared.array(0, dtype)`` gets its shared memory size at
launch, as the fourth item of the launch configuration (the third is the stream):

    kernel[grid, block, 0, nbytes](*args)

Up to 48 KB per block that just works. Above it, CUDA requires the compiled kernel to
be allowed more first, by setting its attribute CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
(the CUDA C++ equivalent is ``cudaFuncSetAttribute(kernel,
cudaFuncAttributeMaxDynamicSharedMemorySize, nbytes)``); without it the launch fails with
CUDA_ERROR_INVALID_VALUE. numba-cuda 0.30 does not expose that attribute
(NVIDIA/numba-cuda#94), so ``allow_dynamic_shared_memory`` sets it through the same
driver binding and the same call numba-cuda itself uses for the shared-memory carveout
(``cuKernelSetAttribute`` on the loaded kernel, in numba-cuda's cudadrv/driver.py).
The maximum is the GPU's: 227 KB per block on the H100/H200 (sm_90), less on others.

Only a real GPU has the limit, so on the simulator this is a no-op; tests/test_smem.py
checks it on a GPU with a kernel that fills and reads 100 KB.
"""

from numba import cuda, uint64

from . import simulating

STATIC_SHARED_LIMIT = 48 * 1024     # what every kernel may use without asking

# The index type for the tiles carved out of a dynamic shared array (forward v5, backward
# v4): ``tile[U(row * row_length + col)]``. The tiles are 1D slices whose length is a
# run-time value, and Numba makes every access with a signed index wrap a negative index
# around by that length (Python's a[-1]): an add and a select per load or store. In the
# SASS of forward v5 (sm_90, d = 64) that doubled the integer instructions of the inner
# loops against v4's static arrays (112 and 79 against 36 and 13 per loop), and v5 ran
# 45 % slower than v4 with the same tiles (lab/runs/2026-12-01/17_v5_sweep.txt). The
# indices are never negative; as unsigned integers they need no wraparound, and the same
# loops compile to 23 and 12 (lab/sweeps/sass_loops.py).
U = uint64


def allow_dynamic_shared_memory(kernel, args, nbytes):
    """Allow ``kernel`` to be launched with ``nbytes`` bytes of dynamic shared memory per
    block, on the current device, for the argument types of ``args``.

    Args:
        kernel: a ``@cuda.jit`` kernel (a numba-cuda dispatcher).
        args: the arguments it will be launched with (only their types matter: the
            attribute belongs to the kernel compiled for those types, which this
            compiles now if it has not been compiled yet).
        nbytes: the dynamic shared memory the launch will ask for, in bytes.

    Returns None. Nothing to do on the simulator, without dynamic shared memory, or when
    nbytes plus the kernel's static shared memory stay within 48 KB (the attribute is
    needed as soon as the two together pass it: the tensor-core decode kernel at d = 72
    asks for 45 KB dynamic beside 5.5 KB static, and its launch failed with
    CUDA_ERROR_INVALID_VALUE before this counted the static part). Cheap enough to call
    before every launch: a type lookup per argument (as the launch itself does), a
    dictionary lookup for the compiled kernel and one driver call.

    Raises:
        ValueError: nbytes more than the device allows a block (its
            MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, less the kernel's static shared memory),
            before anything is launched.
    """
    if simulating() or nbytes <= 0:
        return
    # The compiled kernel for these argument types: the same lookup a launch does
    # (numba-cuda's dispatcher types each argument with typeof_pyval, then compile()).
    compiled = kernel.compile(tuple(kernel.typeof_pyval(a) for a in args))
    function = compiled.library.get_cufunc()    # loaded on the current device
    if nbytes + function.attrs.shared <= STATIC_SHARED_LIMIT:
        return
    device = function.device
    most = device.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN - function.attrs.shared
    if nbytes > most:
        raise ValueError(f"{nbytes} bytes of dynamic shared memory per block asked for; "
                         f"this GPU allows at most {most} (its per-block maximum "
                         f"{device.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN} less the kernel's "
                         f"{function.attrs.shared} bytes of static shared memory)")
    from cuda.bindings.driver import CUfunction_attribute
    from numba.cuda.cudadrv.driver import driver
    attribute = CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    # function.handle is the CUkernel; the driver wrapper raises CudaAPIError on failure.
    driver.cuKernelSetAttribute(attribute, nbytes, function.handle, device.id)


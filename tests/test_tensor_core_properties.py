"""The tensor-core versions (forward v3, v6 to v9, v7 in float16; backward v5 and v6) on
drawn problems, on every backend: the simulator runs them through
numbaflash/kernels/simulated.py, so CI checks the kernels a GPU runs by default on
shapes Hypothesis picks, not only on the fixed shapes of tests/test_simulated_kernels.py.

Each drawn case (strategies.attention_cases: B * H <= 2, ragged Sq and Sk that cross
the versions' tiles, head dims 1 to 16 on the simulator, both causal alignments, three
scales, uniform and tie-heavy values) is checked against the float64 reference by
TESTING.md's rule (tolerance.check_forward, backward_checks.check_backward), with
outputs pre-filled with NaN so that an element a kernel never writes shows.

Budget: a simulated mma is a rendezvous of a warp's 32 Python threads, so a drawn
example costs a second or more there; these tests take half the profile's example count
(10 under CI's profile), per version. The property suites of test_forward_kernels.py and
test_backward_kernels.py draw these versions with their full count on a GPU.
"""

import pytest
from hypothesis import given, reject, settings

import numbaflash
from backward_checks import check_backward
from strategies import attention_cases, examples
from tolerance import check_forward, to_host

pytestmark = pytest.mark.usefixtures("nan_prefilled_outputs")

TENSOR_CORE_EXAMPLES = examples(0.5)

FORWARD = [("v3", "float32"), ("v6", "float32"), ("v8", "float32"), ("v9", "float32"),
           ("v6", "float16"), ("v7", "float16")]
BACKWARD = [("v5", "float32"), ("v6", "float32"), ("v6", "float16")]


def planned(explain, case, version):
    """Reject a drawn case that ``version`` refuses for its shape ("cannot run", e.g.
    v9 at a head dim it does not take); any other error propagates."""
    try:
        explain(case.q, case.k, case.v, causal=case.causal, scale=case.scale,
                version=version)
    except ValueError as err:
        if "cannot run" not in str(err):
            raise
        reject()


@pytest.mark.parametrize("version,dtype", FORWARD)
def test_tensor_core_forward_on_drawn_cases(version, dtype):
    @settings(max_examples=TENSOR_CORE_EXAMPLES)
    @given(case=attention_cases(dtypes=(dtype,), tiles=None))
    def check(case):
        planned(numbaflash.explain, case, version)
        out, lse = numbaflash.attention(case.q, case.k, case.v, causal=case.causal,
                                        scale=case.scale, version=version, return_lse=True)
        check_forward(case.q, case.k, case.v, to_host(out), to_host(lse),
                      causal=case.causal, scale=case.scale)
    check()


@pytest.mark.parametrize("version,dtype", BACKWARD)
def test_tensor_core_backward_on_drawn_cases(version, dtype):
    @settings(max_examples=TENSOR_CORE_EXAMPLES)
    @given(case=attention_cases(dtypes=(dtype,), tiles=None, with_dout=True))
    def check(case):
        planned(numbaflash.explain_backward, case, version)
        kw = dict(causal=case.causal, scale=case.scale)
        out, lse = numbaflash.attention(case.q, case.k, case.v, return_lse=True, **kw)
        out, lse = to_host(out), to_host(lse)
        grads = numbaflash.attention_backward(case.dout, case.q, case.k, case.v, out, lse,
                                              version=version, **kw)
        check_backward(case.dout, case.q, case.k, case.v, out, lse,
                       [to_host(g) for g in grads], **kw)
    check()


"""Which SIMD build of the CPU kernels a call runs when no test pins one: the widest the processor has, except, on
Intel processors whose widest is AVX-512, AVX2 below a size (csrc/cpu/kernels.h: Intel's cores lower their clock
after 512-bit arithmetic, which small calls cannot win back; AMD's do not). The builds' float32 sums run in different
lane orders, so each call's digits say which build ran it."""
import pytest
import torch

import dro_ext
from dro_ext import _backend

# csrc/cpu/kernels.h: kAvx512MinValuesOnePass (the loss forward and backward, the cross-entropy) and
# kAvx512MinValuesSolver (the robust objective and its weights).
ONE_PASS_MIN_VALUES = 16384
SOLVER_MIN_VALUES = 1024

pytestmark = pytest.mark.skipif(not _backend.native_available() or _backend._force_python,
                                reason="the native extension is not loaded: no SIMD build to pick")


def _intel() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.split(":")[-1].strip() == "GenuineIntel" for line in f if line.startswith("vendor_id"))
    except OSError:
        return False


@pytest.fixture
def capability():
    """dro_ext's _cpu_capability op in its automatic setting, the setting it had restored after the test."""
    op = torch.ops.dro_ext._cpu_capability
    previous = op("auto")
    yield op
    op(previous)


def _pinned(capability, build: str, fn):
    previous = capability(build)
    try:
        return fn()
    finally:
        capability(previous)


def _one_pass_calls(n: int, seed: int):
    """The loss forward and backward over n losses, and the fused cross-entropy over n logits (4 columns)."""
    gen = torch.Generator().manual_seed(seed)
    losses = torch.rand(n, generator=gen) * 3
    logits = torch.randn(n // 4, 4, generator=gen)
    targets = torch.randint(0, 4, (n // 4,), generator=gen)

    def run():
        x = losses.clone().requires_grad_()
        eta = torch.tensor(0.5, requires_grad=True)
        value = dro_ext.dro_loss(x, eta, 0.1, "smoothed_cvar", alpha=0.1)
        grads = torch.autograd.grad(value, (x, eta))
        return [value.detach(), *grads, dro_ext.dro_cross_entropy(logits, targets, torch.tensor(0.5), 0.1, "kl")]
    return run


def _solver_calls(n: int, seed: int):
    """The robust objective over n losses and its worst-case weights."""
    losses = torch.rand(n, generator=torch.Generator().manual_seed(seed)) * 3
    return lambda: [dro_ext.robust_objective(losses, 0.1, "chi2")[0], dro_ext.worst_case_weights(losses, 0.1, "chi2")]


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


CASES = [(_one_pass_calls, ONE_PASS_MIN_VALUES - 4), (_one_pass_calls, ONE_PASS_MIN_VALUES),
         (_solver_calls, SOLVER_MIN_VALUES - 4), (_solver_calls, SOLVER_MIN_VALUES)]


@pytest.mark.parametrize("calls, n", CASES, ids=[f"{calls.__name__[1:-6]}-{n}" for calls, n in CASES])
def test_each_call_runs_the_build_its_size_and_processor_call_for(capability, calls, n):
    widest = capability()
    if widest != "avx512":
        pytest.skip(f"this processor's widest build is {widest}: the size rule is about avx512")
    bound = ONE_PASS_MIN_VALUES if calls is _one_pass_calls else SOLVER_MIN_VALUES
    expected = "avx2" if _intel() and n < bound else "avx512"
    distinguished = 0
    for seed in range(8):
        run = calls(n, seed)
        auto = run()
        by_build = {build: _pinned(capability, build, run) for build in ("avx2", "avx512")}
        assert _same(auto, by_build[expected]), f"n = {n}, seed {seed}: not the {expected} build's digits"
        distinguished += not _same(by_build["avx2"], by_build["avx512"])
    # The builds must differ somewhere for the digits to say which one ran.
    assert distinguished > 0


def test_the_setting_returns_what_it_replaced(capability):
    widest = capability()
    assert capability(widest) == "auto"
    assert capability() == widest
    assert capability("auto") == widest
    assert capability("auto") == "auto"


def test_the_setting_names_its_choices(capability):
    with pytest.raises(ValueError, match="'auto', 'default', 'avx2' or 'avx512'"):
        capability("avx1024")
    assert capability() in ("default", "avx2", "avx512")
    assert capability("auto") == "auto"  # the failed call changed nothing

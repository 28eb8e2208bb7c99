"""Which SIMD build of the CPU kernels a call runs when no test pins one: the widest the processor has, except AVX2
below AVX512_MIN_VALUES values where that widest is AVX-512 (csrc/cpu/kernels.h: 512-bit instructions cost Intel
cores clock speed that small calls cannot win back). The builds' float32 sums run in different lane orders, so each
call's digits say which build ran it."""
import pytest
import torch

import dro_ext
from dro_ext import _backend

AVX512_MIN_VALUES = 4096  # kAvx512MinValues in csrc/cpu/kernels.h

pytestmark = pytest.mark.skipif(not _backend.native_available() or _backend._force_python,
                                reason="the native extension is not loaded: no SIMD build to pick")


@pytest.fixture
def capability():
    """dro_ext's _cpu_capability op, and the setting it had restored after the test."""
    op = torch.ops.dro_ext._cpu_capability
    previous = op("auto")
    yield op
    op(previous)


def _widest(capability) -> str:
    return capability()


def _pinned(capability, build: str, fn):
    previous = capability(build)
    try:
        return fn()
    finally:
        capability(previous)


def _calls(n: int, seed: int):
    """Each op family's CPU kernels over n values: the loss forward and backward, the robust objective and its
    worst-case weights, and the fused cross-entropy from the logits (n logits in 4 columns)."""
    gen = torch.Generator().manual_seed(seed)
    losses = torch.rand(n, generator=gen) * 3
    logits = torch.randn(n // 4, 4, generator=gen)
    targets = torch.randint(0, 4, (n // 4,), generator=gen)

    def run():
        x = losses.clone().requires_grad_()
        eta = torch.tensor(0.5, requires_grad=True)
        value = dro_ext.dro_loss(x, eta, 0.1, "smoothed_cvar", alpha=0.1)
        grads = torch.autograd.grad(value, (x, eta))
        psi = dro_ext.robust_objective(losses, 0.1, "chi2")[0]
        weights = dro_ext.worst_case_weights(losses, 0.1, "chi2")
        ce = dro_ext.dro_cross_entropy(logits, targets, torch.tensor(0.5), 0.1, "kl")
        return [value.detach(), *grads, psi, weights, ce]
    return run


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("n", [AVX512_MIN_VALUES - 4, AVX512_MIN_VALUES])
def test_small_calls_run_avx2_where_avx512_is_the_widest(capability, n):
    if _widest(capability) != "avx512":
        pytest.skip(f"this processor's widest build is {_widest(capability)}: the size rule applies to avx512 only")
    expected = "avx2" if n < AVX512_MIN_VALUES else "avx512"
    distinguished = 0
    for seed in range(8):
        run = _calls(n, seed)
        auto = run()
        by_build = {build: _pinned(capability, build, run) for build in ("avx2", "avx512")}
        assert _same(auto, by_build[expected]), f"n = {n}, seed {seed}: not the {expected} build's digits"
        distinguished += not _same(by_build["avx2"], by_build["avx512"])
    # The builds must differ somewhere for the digits to say which one ran.
    assert distinguished > 0


def test_a_pinned_build_runs_at_every_size(capability):
    """What the tests' backend fixture relies on: a pinned avx512 runs avx512 below the size rule's bound too."""
    if _widest(capability) != "avx512":
        pytest.skip(f"this processor's widest build is {_widest(capability)}: the size rule applies to avx512 only")
    runs = [_calls(AVX512_MIN_VALUES - 4, seed) for seed in range(8)]
    assert any(not _same(run(), _pinned(capability, "avx512", run)) for run in runs)


def test_the_setting_returns_what_it_replaced(capability):
    widest = _widest(capability)
    assert capability(widest) == "auto"
    assert capability() == widest
    assert capability("auto") == widest
    assert capability("auto") == "auto"


def test_the_setting_names_its_choices(capability):
    with pytest.raises(ValueError, match="'auto', 'default', 'avx2' or 'avx512'"):
        capability("avx1024")
    assert capability() in ("default", "avx2", "avx512")
    assert capability("auto") == "auto"  # the failed call changed nothing

"""Every CPU build of the native kernels gives the same bits at any thread count, chunk for chunk.

The reductions cut their input into fixed chunks (csrc/cpu/chunks.h) and add the chunks' sums in chunk order, so a
result can depend on the thread count only if one chunk sums differently on one thread than on another. That happened:
at::parallel_for compiles its body twice (a direct call when one thread runs every chunk, an OpenMP region otherwise),
and where the compiler fused a multiply and an add into one FMA in one copy and not in the other, the same chunk of
losses summed to different last bits. The inputs here are two copies of one chunk, so that each copy's sum is
computed by a different thread at two threads and both by the calling thread at one; the sums must agree exactly.
"""
import pytest
import torch

import dro_ext
from reference import CASE_IDS, CASES, case_kwargs

CHUNK = 16384  # csrc/cpu/chunks.h: kReductionChunk


@pytest.fixture
def two_threads():
    """Runs fn at one thread and at two; restores the thread count."""
    threads = torch.get_num_threads()

    def run(fn):
        results = []
        try:
            for n in (1, 2):
                torch.set_num_threads(n)
                results.append(fn())
        finally:
            torch.set_num_threads(threads)
        return results
    return run


def _two_copies_of_a_chunk(dtype, seed):
    chunk = torch.rand(CHUNK, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return torch.cat([chunk, chunk, chunk[:1]])  # a third, partial chunk after the two whole ones


def _assert_same_bits(one, two):
    for a, b in zip(one, two):
        assert torch.equal(a, b), f"1 thread: {a.flatten()[:3].tolist()}, 2 threads: {b.flatten()[:3].tolist()}"


# The FMA that one copy of a chunk's sum fused and the other did not changed its last bit only now and then (a few
# calls in a hundred): the objective and its weights are compared over many lam.
LAMS = [0.01 * 10 ** (i / 4) for i in range(17)]  # 0.01 to 100


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name, params", CASES, ids=CASE_IDS)
def test_the_robust_objective_and_its_weights(backend, two_threads, name, params, dtype):
    losses = 3 * _two_copies_of_a_chunk(dtype, 342)
    kw = case_kwargs(params)

    def run():
        results = []
        for lam in LAMS:
            value, eta = dro_ext.robust_objective(losses, lam, name, **kw)
            results += [value, eta, dro_ext.worst_case_weights(losses, lam, name, **kw)]
        return results
    _assert_same_bits(*two_threads(run))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name, params", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("seed", [342, 7])
def test_the_loss_its_gradients_and_weights(backend, two_threads, name, params, dtype, seed):
    losses = _two_copies_of_a_chunk(dtype, seed)
    kw = case_kwargs(params)

    def run():
        x = losses.clone().requires_grad_()
        eta = torch.tensor(0.5, dtype=torch.float64, requires_grad=True)
        value = dro_ext.dro_loss(x, eta, 0.3, name, **kw)
        weights = dro_ext.dro_weights(losses, 0.5, 0.3, name, **kw)
        return [value.detach(), *torch.autograd.grad(value, (x, eta)), weights]
    _assert_same_bits(*two_threads(run))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_weight_statistics_and_group_sums(backend, two_threads, dtype):
    values = _two_copies_of_a_chunk(dtype, 11)
    groups = torch.cat([torch.arange(CHUNK) % 5, torch.arange(CHUNK) % 5, torch.zeros(1, dtype=torch.long)])

    def run():
        stats = dro_ext.weight_stats(values, groups=groups, num_groups=5)
        return [stats.ess, stats.max_weight, stats.group_mass, dro_ext.group_sums(values, groups, 5)[0]]
    _assert_same_bits(*two_threads(run))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name, params", CASES, ids=CASE_IDS)
def test_the_fused_cross_entropy(backend, two_threads, name, params, dtype):
    rows = torch.randn(CHUNK // 8, 8, dtype=torch.float64).to(dtype)
    logits = torch.cat([rows, rows, rows[:1]])
    target_rows = torch.randint(0, 8, (CHUNK // 8,))
    targets = torch.cat([target_rows, target_rows, target_rows[:1]])

    def run():
        x = logits.clone().requires_grad_()
        value = dro_ext.dro_cross_entropy(x, targets, torch.tensor(1.5, dtype=dtype), 0.3, name, **case_kwargs(params))
        return [value.detach(), *torch.autograd.grad(value, x)]
    _assert_same_bits(*two_threads(run))


@pytest.mark.parametrize("name, params", CASES, ids=CASE_IDS)
def test_the_weights_gradient_to_eta(backend, two_threads, name, params):
    # The autograd formula of dro_weights summed eta's gradient with at::sum, split by the thread count past 32768.
    losses = torch.rand(65537, dtype=torch.float64, generator=torch.Generator().manual_seed(5)).exp().float()
    kw = case_kwargs(params)

    def run():
        eta = torch.tensor(1.4641875936090947, requires_grad=True)
        weights = dro_ext.dro_weights(losses, eta, 3.0, name, **kw)
        return list(torch.autograd.grad(weights, eta, torch.ones_like(weights)))
    _assert_same_bits(*two_threads(run))


@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
def test_a_one_row_chunk_of_a_wide_vocabulary(backend, two_threads, label_smoothing):
    # A chunk of one row had its logits' sums (and label smoothing's mean) as one torch reduction, which torch splits
    # between threads past 32768 elements. The value and the losses are compared, not the gradients: those come from
    # the BLAS's products, which it may split by the thread count over the 50000 classes (MKL does on an Intel Xeon
    # even at a hidden size of 8), as it may any model's matmuls (docs/design.md section 2.5).
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 8, generator=generator)
    weight = 0.3 * torch.randn(50000, 8, generator=generator)
    targets = torch.randint(0, 50000, (3,), generator=generator)

    def run():
        value = dro_ext.dro_linear_cross_entropy(hidden, weight, targets, 0.5, 0.3, "chi2", chunk_size=1,
                                                 label_smoothing=label_smoothing)
        logits = hidden @ weight.t()
        losses = dro_ext.cross_entropy_losses(logits[:1], targets[:1], label_smoothing=label_smoothing)
        return [value, losses]
    _assert_same_bits(*two_threads(run))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_objectives_over_groups(backend, two_threads, dtype):
    """group_dro_loss (each weighting), the exact objective over groups, GroupDROLoss's greedy CVaR step and the
    grouped fused cross-entropy, over more losses than one thread sums and more groups than one thread reduces."""
    values = _two_copies_of_a_chunk(dtype, 13)
    num_groups = 40001
    groups = torch.arange(values.numel()) % num_groups
    weights = torch.rand(num_groups, dtype=torch.float64, generator=torch.Generator().manual_seed(3)) + 0.5
    rows = torch.randn(CHUNK // 8, 8, dtype=torch.float64).to(dtype)
    logits, targets = torch.cat([rows, rows, rows[:1]]), torch.randint(0, 8, (2 * (CHUNK // 8) + 1,))
    token_groups = torch.arange(targets.numel()) % 7

    def run():
        x, eta = values.clone().requires_grad_(), torch.tensor(0.7, dtype=dtype, requires_grad=True)
        out = []
        for weighting in ("batch", "population", weights):
            counts = weights if weighting == "population" else None
            value = dro_ext.group_dro_loss(x, groups, num_groups, eta, 0.4, "kl", weighting=weighting,
                                           group_counts=counts)
            out += [value.detach(), *torch.autograd.grad(value, (x, eta))]
        exact, eta_star = dro_ext.robust_objective(x, 0.4, "chi2", groups=groups, num_groups=num_groups)
        out += [exact.detach(), eta_star, *torch.autograd.grad(exact, x)]
        greedy = dro_ext.GroupDROLoss(num_groups, mode="greedy_cvar", alpha=0.3).to(dtype)
        out += [greedy(x, groups).detach(), greedy(x, groups).detach(), greedy.log_q.clone()]
        z = logits.clone().requires_grad_()
        value = dro_ext.dro_cross_entropy(z, targets, eta, 0.3, "chi2", groups=token_groups, num_groups=7)
        out += [value.detach(), *torch.autograd.grad(value, (z, eta))]
        return out
    _assert_same_bits(*two_threads(run))


def test_group_dro_updates_over_more_groups_than_one_thread_sums(backend, two_threads):
    # The fallback's update normalized log q with torch.logsumexp, whose sum over the groups torch splits between
    # threads past 32768 of them (it differed in 5 of 8 seeds of this case).
    num_groups = 70001
    groups = torch.arange(2 * num_groups) % num_groups

    def run():
        results = []
        for seed in range(4):
            losses = 3 * torch.randn(2 * num_groups, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
            module = dro_ext.GroupDROLoss(num_groups, step_size=2.0).double()
            results += [module(losses, groups), module(losses, groups), module.log_q.clone()]
        return results
    _assert_same_bits(*two_threads(run))


def test_smoothed_cvar_weights_where_a_range_of_the_thread_split_ends(backend, two_threads):
    # The fallback's smoothed_cvar weight was torch.sigmoid, whose float64 kernel takes Sleef's exp in its vector loop
    # and libm's in the scalar loop of a range's tail: the thread count moved element 40000 of these between the two
    # (one rounding apart).
    n = 40001
    losses = torch.randn(n, dtype=torch.float64, generator=torch.Generator().manual_seed(n)).mul(0.7).exp()

    def run():
        x = losses.clone().requires_grad_()
        value, eta = dro_ext.robust_objective(x, 0.4, "smoothed_cvar", alpha=0.1)
        eta = eta.detach().requires_grad_()
        weights = dro_ext.dro_weights(losses, eta, 0.4, "smoothed_cvar", alpha=0.1)
        return [dro_ext.worst_case_weights(losses, 0.4, "smoothed_cvar", alpha=0.1), *torch.autograd.grad(value, x),
                weights, *torch.autograd.grad(weights, eta, torch.ones_like(weights))]
    _assert_same_bits(*two_threads(run))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name, params", CASES, ids=CASE_IDS)
def test_the_loss_gradients_that_a_second_backward_differentiates(backend, two_threads, name, params, dtype):
    # With create_graph=True the native loss's backward forms its gradients from differentiable ops: eta's from the
    # mean weight, the losses' from the weights times the broadcast upstream gradient, whose own gradient is a sum over
    # the losses. Both were plain ATen reductions, which torch splits between threads past 32768 elements.
    n = 65537
    losses = torch.randn(n, dtype=torch.float64, generator=torch.Generator().manual_seed(n)).mul(0.7).exp().to(dtype)
    direction = torch.rand(n, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).to(dtype)
    kw = case_kwargs(params)

    def run():
        x = losses.clone().requires_grad_()
        eta = torch.tensor(0.9, dtype=dtype, requires_grad=True)
        c = torch.tensor(1.3, dtype=dtype, requires_grad=True)
        grad_x, grad_eta = torch.autograd.grad(dro_ext.dro_loss(x, eta, 0.4, name, **kw) * c, (x, eta),
                                               create_graph=True)
        return [grad_x.detach(), grad_eta.detach(),
                *torch.autograd.grad(grad_x, (c, eta, x), direction, retain_graph=True),
                *torch.autograd.grad(grad_eta, (c, eta, x))]
    _assert_same_bits(*two_threads(run))


@pytest.mark.parametrize("name, params", CASES, ids=CASE_IDS)
def test_the_float64_redo_of_a_map_follows_the_losses_not_where_a_vector_ends(backend, two_threads, name, params):
    # Losses near G eta = 1e9 at lam = 1e-30: every t = (l - G eta)/lam fits float32, but |G eta| / lam does not. The
    # map's overflow check read a partial vector's unused lanes as losses of 0 (|t| = |G eta| / lam): a false alarm
    # that redid the map in float64 where a task of at::parallel_for ended off a vector's boundary (here the first
    # of two threads' halves, 8k + 4 losses) or the batch did (one loss fewer), and not elsewhere.
    shift, lam = 1e9, 1e-30
    steps = torch.randint(-3, 40, (2 * (8 * 4096 + 4),), generator=torch.Generator().manual_seed(5))
    losses = (shift + 64.0 * steps.double()).float()  # exact float32 numbers, 64 apart
    kw = case_kwargs(params)

    def run():
        x = losses.clone().requires_grad_()
        value = dro_ext.dro_loss(x, shift, lam, name, **kw)
        return [value.detach(), *torch.autograd.grad(value, x), dro_ext.dro_weights(losses, shift, lam, name, **kw)]
    one, two = two_threads(run)
    _assert_same_bits(one, two)
    _assert_same_bits(one[2][:-1], dro_ext.dro_weights(losses[:-1], shift, lam, name, **kw))

"""NormalizedSGD: mini-batch normalized SGD with momentum, Algorithm 1 of the paper (docs/design.md section 1.8).

    m <- beta * m + (1 - beta) * g                (m <- g on a parameter's first step)
    p <- (1 - lr * weight_decay) * p - lr * m / (||m|| + eps)

||m|| is the L2 norm over every parameter of the param group (``norm="global"``, the paper's) or of each
tensor alone (``norm="tensor"``). Two implementations compute this: the fused native op
``torch.ops.dro_ext.normalized_sgd_step_`` (one multi-tensor call per group, no host sync) and a
``torch._foreach_*`` fallback.
"""
from __future__ import annotations

import math
import numbers
import operator
from itertools import repeat
from typing import Any, Callable, Literal, cast, overload

import torch
from torch.optim import Optimizer
from torch.optim.optimizer import ParamsT

from dro_ext import _backend
from dro_ext import distributed as _distributed
from dro_ext._divergences import FLOATING_DTYPES, wide_number

__all__ = ["NormalizedSGD", "DEFAULT_EPS"]

# Algorithm 1 has no eps: m/||m|| is a unit vector however small ||m|| is, and an exactly zero momentum
# is handled on its own (no step). eps does two things: it bounds the step factor lr/(||m|| + eps) by
# lr/eps, so it stays finite in float32 for subnormal momenta; and once ||m|| is comparable to eps it
# shrinks the step to lr*||m||/(||m|| + eps), SGD with step lr/eps, which makes the step depend on the
# scale of the loss. The default keeps the first and avoids the second: 1e-8 lies far below the momentum
# norm of any float32 model worth training, per tensor too (norm="tensor" on a small bias), so the step
# keeps the fixed length lr of Algorithm 1. The paper's experiments used eps=0.1 (Appendix E) and the
# authors' earlier NormalizedSGD 1e-6, tuned choices: pass them to reproduce those runs.
DEFAULT_EPS = 1e-8

_NORMS = ("global", "tensor")


if _backend.native_available():

    @torch.library.register_fake("dro_ext::normalized_sgd_step_")
    def _normalized_sgd_step_fake(
        params: list[torch.Tensor], grads: list[torch.Tensor], momenta: list[torch.Tensor], steps: list[torch.Tensor],
        lr: torch.Tensor, momentum: float, eps: float, weight_decay: float = 0.0, norm: str = "global",
        maximize: bool = False, grad_scale: torch.Tensor | None = None, found_inf: torch.Tensor | None = None,
    ) -> None:
        if params:
            _backend.check_fake_operands_on(params[0].device, [*params, *grads, *momenta, *steps],
                                            "dro_ext: a tensor of the step is on {device} but params[0] is on "
                                            "{expected}; every tensor of one call must sit on one device")
        for i, (p, m) in enumerate(zip(params, momenta)):
            # As the op refuses it (csrc/normalized_sgd_checks.h), so that a traced step takes the path the eager one
            # takes where a model cast after a step left the momentum in its old dtype (NormalizedSGD.step's except).
            if m.dtype != p.dtype:
                raise ValueError(f"dro_ext: momenta[{i}] must match params[{i}] ({p.dtype}), got {m.dtype}")
        return None


def _check_number(name: str, value: object, *, low: float, high: float | None = None) -> None:
    """value must be a finite number (or one-element Tensor) in [low, high), or >= low without high."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"dro_ext.NormalizedSGD: {name} as a Tensor must hold one element, got shape "
                             f"{tuple(value.shape)}")
        number = float(value.detach().cpu())
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):  # numpy's scalars too, as torch's SGD
        number = float(value)
    else:
        raise TypeError(f"dro_ext.NormalizedSGD: {name} must be a number, got {value!r} ({type(value).__name__})")
    allowed = f"in [{low}, {high})" if high is not None else f">= {low}"
    if not math.isfinite(number) or number < low or (high is not None and number >= high):
        raise ValueError(f"dro_ext.NormalizedSGD: {name} must be a finite number {allowed}, got {name}={number}")


class NormalizedSGD(Optimizer):
    """Normalized SGD with momentum (Jin et al., NeurIPS 2021, Algorithm 1).

    Each step moves the parameters of a param group by ``lr * ||m|| / (||m|| + eps)``, i.e. by ``lr``
    whenever ``||m|| >> eps``, in the direction of the momentum ``m``. Use it on everything the loss
    depends on, the ``eta`` of :class:`dro_ext.DROLoss` included.

    Args:
        params: parameters or param groups; each group has its own norm.
        lr: step length (float or one-element Tensor, >= 0).
        momentum: beta in [0, 1); ``m = beta*m + (1-beta)*g``, ``m = g`` on the first step.
        eps: added to ``||m||`` (>= 0). Default 1e-8: only guards the division, so the step keeps the
            fixed length of Algorithm 1 and stays invariant to the scale of the loss (see DEFAULT_EPS).
            A momentum that is exactly zero never moves the parameters, whatever eps.
        weight_decay: decoupled: ``p *= 1 - lr*weight_decay`` each step, independent of the momentum.
        norm: ``"global"`` (over the whole group, the paper's) or ``"tensor"`` (each tensor alone). A param whose
            ``.grad`` is None takes no part in the step, as in torch.optim: it does not move, and its momentum is
            neither decayed nor counted in the norm.
        maximize: ascend instead of descend.
        foreach: True selects the ``torch._foreach_*`` implementation (also what ``fused=False`` runs).
        fused: True selects the fused native op (it must be built, and every parameter of a group must
            sit on one device); None picks it where it is loaded, has a kernel for the group's device and
            ``foreach`` is not True, and the foreach implementation elsewhere. ``load_state_dict`` keeps this
            optimizer's ``foreach`` and ``fused``, not the checkpoint's: they say how this process steps.

    No two params may share memory (each is updated in place). As ATen's own overlap checks: two dense params whose
    bytes, from the first element to the last, meet are refused, as is one given twice; a strided view with gaps (a
    column slice) is compared only with the same view given twice, so views apart element by element step. A
    foreach step compiled by torch.compile checks only that no param is given twice (a traced step has no addresses
    to compare); the fused op checks at run time.

    The momentum has its parameter's dtype and device: where a model is cast or moved after a step
    (``model.double()``, ``model.to(device)``), the next step casts each momentum to its parameter, as
    ``load_state_dict`` casts a loaded one. ``lr`` and the other options set on a group later are checked at the step,
    every group's before any group steps (a tensor ``momentum``, ``eps`` or ``weight_decay``: its value, read once on
    the host, as the fused op takes numbers).

    Works with ``torch.amp.GradScaler`` (it passes ``grad_scale``/``found_inf``: gradients are unscaled
    inside the step and a step with an inf/NaN gradient is skipped entirely). The fused step reads them
    where it runs, without a host sync; the fallback reads ``found_inf`` on the host.

    Without GradScaler, a NaN gradient is not dropped: it reaches the momentum and, through ``scale * m``, the
    parameters where it sits, while the rest of the group does not move (its norm is NaN, and a norm that is not
    > 0 gives the factor 0). The NaN stays in the momentum, so that group moves no more until its state is reset
    (``optimizer.state.clear()``). An inf gradient likewise makes the norm inf: its own entries become NaN, the others
    stay. The norm is a float64 sum of squares: float64 momenta of 1e154 or more overflow it (the group does not
    move). With ``eps=0``, float64 momenta below about 1e-160 underflow it (the group does not move), and a float32
    or half group whose norm is below ``lr / 3.4e38`` gets a factor ``lr / ||m||`` past float32's range (its
    parameters become inf); the default ``eps`` keeps the factor below ``lr / eps``.
    """

    _step_supports_amp_scaling = True

    def __init__(self, params: ParamsT, lr: float | torch.Tensor, momentum: float = 0.9, *, eps: float = DEFAULT_EPS,
                 weight_decay: float = 0.0, norm: Literal["global", "tensor"] = "global", maximize: bool = False,
                 foreach: bool | None = None, fused: bool | None = None) -> None:
        if fused and foreach:
            raise ValueError("dro_ext.NormalizedSGD: fused=True and foreach=True are mutually exclusive")
        if fused and not _backend.native_available():
            raise RuntimeError(f"dro_ext.NormalizedSGD: fused=True needs the native op normalized_sgd_step_, "
                               f"which is not loaded (extension load error: {_backend.load_error()})")
        defaults = dict(lr=lr, momentum=momentum, eps=eps, weight_decay=weight_decay, norm=norm,
                        maximize=maximize, foreach=foreach, fused=fused)
        super().__init__(params, defaults)
        self._plans: dict[int, _GroupPlan] = {}  # id(group) -> the _GroupPlan kept for the group's next step (_plan)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        # Checked per group, so a group that overrides a default gets the same errors as the constructor; a group
        # that fails is taken out again (a caller that catches the error must not step it).
        super().add_param_group(param_group)
        self._keep_current_plans()
        try:
            _check_group(self.param_groups[-1])
        except (TypeError, ValueError):
            self.param_groups.pop()
            raise

    def _keep_current_plans(self) -> None:
        """Only the plans of the groups in param_groups: a group taken out (param_groups.pop(), then a step or an
        add_param_group) kept its params and momenta alive in its plan."""
        current = {id(g) for g in self.param_groups}
        self._plans = {key: plan for key, plan in self.__dict__.get("_plans", {}).items() if key in current}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # fused and foreach say how this process runs the step, not what the run learned: each group keeps this
        # optimizer's (torch.optim's load takes the saved ones, so a checkpoint saved with fused=True overrode a
        # foreach=True here, and raised at the first step where the native ops are not built).
        implementations = [(group["fused"], group["foreach"]) for group in self.param_groups]
        super().load_state_dict(state_dict)  # (which refuses another number of groups)
        for group, (fused, foreach) in zip(self.param_groups, implementations):
            group["fused"], group["foreach"] = fused, foreach

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)  # load_state_dict comes here too, with the new state and groups
        self._plans = {}
        for group in self.param_groups:
            # The settings a group saved by another optimizer (torch.optim.SGD's) or an older NormalizedSGD lacks.
            group.setdefault("eps", DEFAULT_EPS)
            group.setdefault("weight_decay", 0.0)
            group.setdefault("norm", "global")
            group.setdefault("maximize", False)
            group.setdefault("foreach", None)
            group.setdefault("fused", None)

    def _init_group(self, group: dict[str, Any], params: list[torch.Tensor], grads: list[torch.Tensor],
                    momenta: list[torch.Tensor], steps: list[torch.Tensor]) -> bool:
        for index, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("dro_ext.NormalizedSGD does not support sparse gradients")
            state = self.state[p]
            if len(state) == 0:
                # The step count lives beside the parameter as a tensor: the first-step rule m = g and
                # the GradScaler skip are decided where the kernel runs, not on the host.
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            else:
                _check_loaded_state(state, p, index)
            step = state["step"]
            if step.device != p.device or step.dtype != torch.float32 or step.dim() != 0:
                # load_state_dict leaves "step" where and as it was saved (a CPU checkpoint for a CUDA model, another
                # optimizer's int64 or float64 count); the fused kernel reads and counts a 0-d float32 beside its
                # parameter. Converted once, not every step.
                state["step"] = step.to(device=p.device, dtype=torch.float32).reshape(())
            params.append(p)
            grads.append(p.grad)
            momenta.append(state["momentum_buffer"])
            steps.append(state["step"])
        return False

    def _use_fused(self, group: dict[str, Any], params: list[torch.Tensor]) -> bool:
        if group["fused"]:
            if not _backend.use_native():
                raise RuntimeError("dro_ext.NormalizedSGD: fused=True but the native ops are disabled "
                                   "(DRO_EXT_FORCE_PYTHON=1 or the extension did not load)")
            return True
        if group["fused"] is not None or group["foreach"]:
            return False
        # Automatic choice: the fused op where it has a kernel for the group's one device, else foreach.
        device = params[0].device
        return _backend.native_for(device.type) and all(p.device == device for p in params)

    def _plan(self, group: dict[str, Any]) -> tuple[_GroupPlan, _TensorLists]:
        """The group's plan and its (grads, momenta, steps) for this step: the kept plan while it still holds, else a
        new one (kept when every param of the group has a gradient). At ~150 tensors, _init_group's checks cost more
        host time than the kernels' launches; a kept plan reads only p.grad and the state entries."""
        caching = not torch.compiler.is_compiling()  # the cache is host bookkeeping torch.compile need not trace
        plan = self._plans.get(id(group)) if caching else None
        if plan is not None and plan.valid_for(self, group):
            lists = plan.lists()
            if lists is not None:
                return plan, lists
        params: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        momenta: list[torch.Tensor] = []
        steps: list[torch.Tensor] = []
        self._init_group(group, params, grads, momenta, steps)
        plan = _GroupPlan(self, group, params, keeping=caching)
        if caching:
            # Only the plans of the optimizer's groups stay: another would keep old momentum buffers alive.
            self._plans = {id(g): self._plans[id(g)] for g in self.param_groups
                           if g is not group and id(g) in self._plans}
            if plan.reusable:
                self._plans[id(group)] = plan
        return plan, (grads, momenta, steps)

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        if len(self._plans) > len(self.param_groups):
            self._keep_current_plans()
        planned = [(group, *self._plan(group)) for group in self.param_groups]
        # Every group's options are checked before any group steps: a refusal of a later group's left the earlier
        # groups stepped, and a caller that set the option right and stepped again stepped those twice.
        hyperparameters = [_check_step_options(group, plan) if plan.params else None for group, plan, _ in planned]
        for (group, plan, (grads, momenta, steps)), checked in zip(planned, hyperparameters):
            if checked is None:
                continue
            options = dict(lr=group["lr"], **checked, norm=group["norm"], maximize=group["maximize"],
                           grad_scale=grad_scale, found_inf=found_inf)
            if plan.dtensor:  # FSDP2: local shards, one all-reduce for the norm
                _distributed.sharded_normalized_sgd_step(plan.params, grads, momenta, steps, fused=plan.fused,
                                                         foreach_momentum=_grouped_foreach_momentum_,
                                                         descend=_grouped_descend_, **options)
            elif plan.fused:
                if torch.compiler.is_compiling():
                    # Traced: the op's refusal below would reach the except as Dynamo's own error, so the state
                    # follows the params before the call (free at run time: a traced check).
                    self._state_follows_params(plan.params, momenta, steps)
                try:
                    _fused_step(plan.params, grads, momenta, steps, **options)
                except ValueError:
                    # The op checks every operand before it writes any. Where it refused params on shared memory,
                    # they are named by their places in their group (the op's are in its list, of the params with a
                    # gradient). Where it refused a state that a cast of the model left behind, the state follows the
                    # params and the step runs; anything else stands.
                    _refuse_shared_memory(self, group, plan.params)
                    if not self._state_follows_params(plan.params, momenta, steps):
                        raise
                    _fused_step(plan.params, grads, momenta, steps, **options)
            else:
                self._state_follows_params(plan.params, momenta, steps)
                _foreach_step(plan.params, grads, momenta, steps, **options)
        return loss

    def _state_follows_params(self, params: list[torch.Tensor], momenta: list[torch.Tensor],
                              steps: list[torch.Tensor]) -> bool:
        """Each momentum moved to its param's dtype and device, and each step count to its device, where the param
        moved after they were made (``model.double()`` or ``.to(device)`` after a step, which casts a param in place:
        the same object, a kept plan), as load_state_dict casts a loaded momentum; in the state and in the lists.
        Whether any moved. Either step then carries the momentum at the param's precision, the fused one as the
        foreach one."""
        moved = False
        for i, p in enumerate(params):
            m, step = momenta[i], steps[i]
            if m.dtype != p.dtype or m.device != p.device:
                momenta[i] = self.state[p]["momentum_buffer"] = m.to(device=p.device, dtype=p.dtype)
                moved = True
            if step.device != p.device:
                steps[i] = self.state[p]["step"] = step.to(p.device)
                moved = True
        return moved


# A param group's (grads, momenta, steps) for a step.
_TensorLists = tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]


class _GroupPlan:
    """One param group's step as decided from its params (those with a gradient, from _init_group): their state
    entries, whether they are sharded (DTensor) and whether the fused op runs. A plan is kept for the next step
    (NormalizedSGD._plan) when every param of the group had a gradient, and serves while `valid_for` holds: the same
    group, param list and state dict (load_state_dict replaces both; add_param_group adds a group with a plan of
    its own) and the same "fused"/"foreach" settings and backend."""

    __slots__ = ("group", "group_params", "num_params", "state", "settings", "params", "states", "dtensor", "fused",
                 "reusable")

    def __init__(self, optimizer: NormalizedSGD, group: dict[str, Any], params: list[torch.Tensor],
                 keeping: bool) -> None:
        self.group, self.group_params, self.num_params = group, group["params"], len(group["params"])
        self.state, self.settings = optimizer.state, _settings(group)
        self.params = params
        self.dtensor = len(params) > 0 and _distributed.has_dtensor(params)
        self.fused = len(params) > 0 and optimizer._use_fused(group, params)
        if self.fused and not self.dtensor:
            _check_one_device(params)
        elif not self.fused:
            # (Once per plan: a kept plan keeps its params. The fused op checks its lists itself, at no cost here.)
            _refuse_shared_memory(optimizer, group, params)
        self.reusable = keeping and 0 < len(params) == self.num_params
        # The state entries that a kept plan's later steps read. Only for a plan that is kept: while compiling (when
        # none is) dynamo traced this read of the state dict wrongly for a second param group (wrong steps).
        self.states = [optimizer.state[p] for p in params] if self.reusable else None

    def valid_for(self, optimizer: NormalizedSGD, group: dict[str, Any]) -> bool:
        return (self.group is group and self.group_params is group["params"]
                and self.num_params == len(group["params"]) and self.state is optimizer.state
                and self.settings == _settings(group))

    def lists(self) -> _TensorLists | None:
        """(grads, momenta, steps) of the plan's params as they are now; None where the plan no longer holds: a param
        of the group replaced in its list, a state entry replaced or removed (``optimizer.state.clear()``,
        ``del optimizer.state[p]``: that param starts over, m = g, as torch.optim.SGD's does), or a param's gradient
        or momentum gone."""
        states = self.states
        if states is None:  # a plan that is not kept (it has no lists to give)
            return None
        # The group's params as they are now (the list valid_for checked), each with the state entry the plan holds:
        # one pass in C over both, a few ns a param.
        if not all(map(operator.is_, map(self.state.get, self.group_params), states)):
            return None
        grads = [p.grad for p in self.params]
        if not all(map(operator.is_not, grads, repeat(None))):
            return None
        try:
            # cast: no gradient is None, as checked just above
            return (cast("list[torch.Tensor]", grads), [s["momentum_buffer"] for s in states],
                    [s["step"] for s in states])
        except KeyError:
            return None


def _check_group(group: dict[str, Any]) -> None:
    """A param group's options, as the constructor and add_param_group take them."""
    _check_number("lr", group["lr"], low=0.0)
    _check_number("momentum", group["momentum"], low=0.0, high=1.0)
    _check_number("eps", group["eps"], low=0.0)
    _check_number("weight_decay", group["weight_decay"], low=0.0)
    if group["norm"] not in _NORMS:
        raise ValueError(f"dro_ext.NormalizedSGD: norm must be one of {_NORMS}, got {group['norm']!r}")
    if not isinstance(group["maximize"], bool):  # (1 would pass the fused op's bool argument as True)
        raise TypeError(f"dro_ext.NormalizedSGD: maximize must be a bool, got {group['maximize']!r}")
    for p in group["params"]:
        if p.dtype not in FLOATING_DTYPES:
            raise ValueError(f"dro_ext.NormalizedSGD: parameters must be floating point, got {p.dtype}")


def _check_loaded_state(state: dict[str, Any], p: torch.Tensor, index: int) -> None:
    """A state entry that NormalizedSGD did not make (a loaded state_dict: another optimizer's, an older one): its
    momentum must be one of the param's shape, and its step count a number (a tensor is made of a Python one, as
    torch.optim's own optimizers take an old checkpoint's)."""
    momentum, step = state.get("momentum_buffer"), state.get("step")
    if not isinstance(momentum, torch.Tensor) or step is None:
        raise ValueError(f"dro_ext.NormalizedSGD: the state of param {index} of its group has no 'momentum_buffer' "
                         f"tensor and 'step' (its keys: {sorted(state)}): a state_dict of another optimizer? Load "
                         f"one that NormalizedSGD saved, or clear optimizer.state")
    if momentum.shape != p.shape:
        raise ValueError(f"dro_ext.NormalizedSGD: the momentum_buffer of param {index} of its group has shape "
                         f"{tuple(momentum.shape)}, the param {tuple(p.shape)}: a state_dict of another model?")
    if _distributed.has_dtensor([p]) != _distributed.has_dtensor([momentum]):
        # A whole momentum beside a param's local shard (a single process's state_dict loaded into a sharded model,
        # or the reverse): the foreach step broadcast one into the other on some ranks and waited in the norm's
        # collective on the others.
        kinds = ("a DTensor", "a plain tensor") if _distributed.has_dtensor([p]) else ("a plain tensor", "a DTensor")
        raise ValueError(f"dro_ext.NormalizedSGD: param {index} of its group is {kinds[0]} and its loaded "
                         f"momentum_buffer {kinds[1]}: load a sharded model's optimizer state with "
                         "torch.distributed.checkpoint.state_dict.set_optimizer_state_dict, which shards it")
    if not isinstance(step, torch.Tensor):
        state["step"] = torch.tensor(float(step), dtype=torch.float32, device=p.device)


def _settings(group: dict[str, Any]) -> tuple[bool | None, bool | None, bool]:
    return group["fused"], group["foreach"], _backend.use_native()


def _check_one_device(params: list[torch.Tensor]) -> None:
    device = params[0].device
    if any(p.device != device for p in params):
        raise ValueError("dro_ext.NormalizedSGD: the fused step needs every parameter of a group on one device "
                         "(the global norm spans the group); use foreach=True for a group across devices")


def _fused_step(params: list[torch.Tensor], grads: list[torch.Tensor], momenta: list[torch.Tensor],
                steps: list[torch.Tensor], *, lr: float | torch.Tensor, momentum: float, eps: float,
                weight_decay: float, norm: str, maximize: bool, grad_scale: torch.Tensor | None,
                found_inf: torch.Tensor | None) -> None:
    # _GroupPlan checked that every param sits on one device.
    if not isinstance(lr, torch.Tensor):
        # Made anew each step (~2 us): a tensor kept across steps would be whatever the first step's mode made it
        # (a FakeTensor under FakeTensorMode, say) for every later step. Compiled, as a product with the float:
        # torch.tensor(lr) bakes the value into the graph, so a scheduler's every new lr recompiled the step (and
        # fullgraph=True failed at the recompile limit), where the product lets Dynamo take lr as a symbol.
        if torch.compiler.is_compiling():
            lr = torch.ones((), dtype=torch.float64) * lr
        else:
            lr = torch.tensor(lr, dtype=torch.float64)
    torch.ops.dro_ext.normalized_sgd_step_(
        params, grads, momenta, steps, lr, momentum, eps, weight_decay, norm, maximize, grad_scale, found_inf
    )


def _foreach_momentum_(grads: list[torch.Tensor], momenta: list[torch.Tensor], steps: list[torch.Tensor], *,
                       momentum: float, maximize: bool, grad_scale: torch.Tensor | None) -> None:
    """The momentum rule, on tensors of one device and dtype: m <- beta m + take g with take = 1 - beta, and 1 on a
    tensor's first step (step == 0, m == 0), negated for maximize and divided by GradScaler's grad_scale; steps += 1.
    The fused op's kernels apply the same rule (csrc/normalized_sgd.cpp, csrc/cuda/normalized_sgd.cu)."""
    acc = torch.float64 if momenta[0].dtype == torch.float64 else torch.float32
    momentum = wide_number(momentum)
    started = torch.stack(steps).clamp_max(1.0).to(torch.float64)
    take = (-1.0 if maximize else 1.0) * (1.0 - momentum * started)
    if grad_scale is not None:
        take = take / grad_scale.to(device=started.device, dtype=torch.float64)
    # float16/bfloat16: m = beta m + take g in float32, rounded once, as the fused kernels form it. Rounded after
    # each op, 0.999 m would round back to m in bfloat16 (its spacing is 2^-8 of m): a momentum that never decays.
    wide = acc != momenta[0].dtype
    targets = [m.to(acc) for m in momenta] if wide else momenta
    torch._foreach_mul_(targets, _foreach_factor(momentum, momenta[0].device, acc))
    torch._foreach_addcmul_(targets, [g.to(acc) for g in grads] if wide else grads, list(take.to(acc).unbind()))
    if wide:
        torch._foreach_copy_(momenta, targets)
    torch._foreach_add_(steps, 1.0)


def _grouped_foreach_momentum_(grads: list[torch.Tensor], momenta: list[torch.Tensor], steps: list[torch.Tensor], *,
                               momentum: float, maximize: bool, grad_scale: torch.Tensor | None) -> None:
    """_foreach_momentum_ on tensors of any devices and dtypes, a (device, dtype) at a time."""
    for b_grads, b_momenta, b_steps in _group_by_device_and_dtype([grads, momenta, steps]).values():
        _foreach_momentum_(b_grads, b_momenta, b_steps, momentum=momentum, maximize=maximize, grad_scale=grad_scale)


def _check_step_options(group: dict[str, Any], plan: _GroupPlan) -> dict[str, Any]:
    """A group's options as its step takes them: set on the group after construction (a user's, a scheduler's), each
    refused as the constructor refuses it. Returns the momentum, eps and weight_decay the step passes on: for the
    fused op, a tensor's value read here (the op takes numbers and read it itself, after the groups before its own
    had stepped), once, as the op would have; the foreach and sharded steps take them as they are."""
    lr = group["lr"]
    # The op takes lr as a tensor and cannot read it: a negative lr ascended, a NaN one made every param NaN. (A
    # tensor lr is checked when given; its later values are not read: no host sync per step.) 0 <= lr < inf: see eps
    # in _check_step_hyperparameters.
    if not isinstance(lr, torch.Tensor) and not 0.0 <= lr < math.inf:
        raise ValueError(f"dro_ext.NormalizedSGD: lr must be a finite number >= 0.0, got lr={lr}")
    momentum, eps, weight_decay = group["momentum"], group["eps"], group["weight_decay"]
    if plan.fused and not plan.dtensor:
        momentum, eps, weight_decay = (float(h) for h in (momentum, eps, weight_decay))
    _check_step_hyperparameters(momentum, eps, weight_decay, group["norm"])
    return dict(momentum=momentum, eps=eps, weight_decay=weight_decay)


def _check_step_hyperparameters(momentum: float, eps: float, weight_decay: float, norm: str) -> None:
    """The options of a group as a step takes them (set on the group after construction, say), with the errors of the
    fused op's check_step_hyperparameters (csrc/normalized_sgd_checks.h): either step refuses what the other does."""
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"dro_ext: momentum must be in [0, 1), got {momentum}")
    # (0 <= x < inf rather than math.isfinite, which Dynamo cannot trace once a changed value made x symbolic; a NaN
    # fails both comparisons)
    if not 0.0 <= eps < math.inf:
        raise ValueError(f"dro_ext: eps must be a finite number >= 0, got {eps}")
    if not 0.0 <= weight_decay < math.inf:
        raise ValueError(f"dro_ext: weight_decay must be a finite number >= 0, got {weight_decay}")
    if norm not in _NORMS:
        raise ValueError(f"dro_ext: norm must be 'global' or 'tensor', got '{norm}'")


_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def _refuse_shared_memory(optimizer: Optimizer, group: dict[str, Any], params: list[torch.Tensor]) -> None:
    """The refusal of a group's params on shared memory (_params_sharing_memory), naming them by their places in the
    group (``params`` are those with a gradient, in the group's order) and the group by its place."""
    shared = _params_sharing_memory(params)
    if shared is None:
        return
    places = [i for i, p in enumerate(group["params"]) if p.grad is not None]
    number = next(k for k, g in enumerate(optimizer.param_groups) if g is group)
    raise ValueError(f"dro_ext: params[{places[shared[0]]}] and params[{places[shared[1]]}] of param group {number} "
                     "share memory; the step updates each in place, so no two may overlap")


def _params_sharing_memory(params: list[torch.Tensor]) -> tuple[int, int] | None:
    """Two places in ``params`` whose memory is shared, or None: the step updates each param in place, so the foreach
    step would update shared elements twice, and the fused op's threads (or CUDA blocks) at once. Shared as the fused
    op's check_each_tensor_once takes it, after ATen's own overlap checks: a dense tensor holds the bytes from its
    first element to its last, and two such spans that meet are shared; a strided view with gaps counts as shared
    only with the same view given twice. Where there is no address to read (a traced step, fake or meta tensors,
    which share a null one, and tensor subclasses such as DTensor), by identity: the same tensor given twice."""
    seen: dict[object, int] = {}
    spans: dict[torch.device, list[tuple[int, int, int]]] = {}
    compiling = torch.compiler.is_compiling()
    for i, p in enumerate(params):
        # (A FakeTensor's class is its own; a meta tensor's address, and an empty one's, is null.)
        begin = 0 if compiling or p.__class__ not in _PLAIN_TENSOR_TYPES else p.data_ptr()
        if begin != 0 and (p.is_contiguous() or _dense(p)):
            nbytes = p.nbytes
            if nbytes > 0:
                spans.setdefault(p.device, []).append((begin, begin + nbytes, i))
        elif p.numel() > 0:
            j = seen.setdefault(id(p) if begin == 0 else (p.device, begin, p.shape, p.stride()), i)
            if j != i:
                return j, i
    for device_spans in spans.values():
        device_spans.sort()
        # Sorted by start, any overlap shows between neighbours (a span that meets a later one meets the next too).
        for (_, reach, j), (begin, _, i) in zip(device_spans, device_spans[1:]):
            if begin < reach:
                return min(i, j), max(i, j)
    return None


def _dense(p: torch.Tensor) -> bool:
    """Whether p's elements fill the bytes from its first to its last, in some order of its dims (channels_last, a
    transpose): ATen's is_non_overlapping_and_dense."""
    expected = 1
    for stride, size in sorted(zip(p.stride(), p.shape)):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def _foreach_step(params: list[torch.Tensor], grads: list[torch.Tensor], momenta: list[torch.Tensor],
                  steps: list[torch.Tensor], *, lr: float | torch.Tensor, momentum: float, eps: float,
                  weight_decay: float, norm: str, maximize: bool, grad_scale: torch.Tensor | None,
                  found_inf: torch.Tensor | None) -> None:
    if found_inf is not None and bool(found_inf.ne(0).any()):
        return
    buckets = _group_by_device_and_dtype([params, grads, momenta, steps])
    sumsq: list[torch.Tensor] = []
    norms_per_bucket: list[torch.Tensor] = []
    for (_, b_grads, b_momenta, b_steps) in buckets.values():
        _foreach_momentum_(b_grads, b_momenta, b_steps, momentum=momentum, maximize=maximize, grad_scale=grad_scale)
        # In float64: float32 squares of tiny (< 1e-19) or huge (> 1e19) momenta under- or overflow.
        norms = torch.stack(torch._foreach_norm(b_momenta, 2, dtype=torch.float64))
        norms_per_bucket.append(norms)
        sumsq.append(norms.square().sum())
    first_device = next(iter(buckets))[0]
    total = torch.sqrt(torch.stack([s.to(first_device) for s in sumsq]).sum())
    lr_t, weight_decay = wide_number(lr), wide_number(weight_decay)
    decay = 1.0 - lr_t * weight_decay if weight_decay != 0.0 else None
    for ((device, _), (b_params, _, b_momenta, _)), norms in zip(buckets.items(), norms_per_bucket):
        denom = norms if norm == "tensor" else total.to(device).expand_as(norms)
        # A zero momentum must not move p: scale 0 there, not lr/eps (or 0/0 when eps == 0).
        _descend_(b_params, b_momenta, torch.where(denom > 0, lr_t / (denom + eps), torch.zeros_like(denom)), decay)


def _descend_(params: list[torch.Tensor], momenta: list[torch.Tensor], scales: torch.Tensor,
              decay: float | torch.Tensor | None) -> None:
    """p <- decay p - s m for params of one device and dtype, s their entries of the 1-D ``scales`` (any float dtype),
    ``decay`` None without weight decay. float16/bfloat16: in float32, rounded once, as the fused kernel forms it. The
    factor lr / (||m|| + eps) need not fit their range (1.4e6 for a float16 momentum of 6e-8, lr 0.1), nor its product
    with m their precision, though the step itself does."""
    dtype, device = params[0].dtype, params[0].device
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    wide = acc != dtype
    targets = [p.to(acc) for p in params] if wide else params
    if decay is not None:
        torch._foreach_mul_(targets, _foreach_factor(decay, device, acc))
    torch._foreach_addcmul_(targets, [m.to(acc) for m in momenta] if wide else momenta,
                            list(scales.to(acc).unbind()), value=-1)
    if wide:
        torch._foreach_copy_(params, targets)


def _foreach_factor(value: float | torch.Tensor, device: torch.device, dtype: torch.dtype) -> float | torch.Tensor:
    """A factor for torch._foreach_mul_ on tensors of ``device`` accumulated in ``dtype``: a one-element tensor (an lr
    given as a tensor, and the weight decay's factor made from it) as the 0-d tensor the op takes; a float as it is,
    but under torch.compile as a 0-d tensor (formed in float64, rounded once, as the op rounds the float): Inductor
    writes the example value of a float that Dynamo made symbolic (an lr or momentum that a scheduler changes) into
    its foreach kernel, and the compiled step kept using the first value it recompiled for."""
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=dtype).reshape(())
    if torch.compiler.is_compiling():
        return (torch.ones((), dtype=torch.float64, device=device) * value).to(dtype)
    return value


def _grouped_descend_(params: list[torch.Tensor], momenta: list[torch.Tensor], scales: list[torch.Tensor],
                      decay: float | torch.Tensor | None) -> None:
    """_descend_ on params of any devices and dtypes, a (device, dtype) at a time; ``scales`` one 0-d tensor per
    param, on its device."""
    for b_params, b_momenta, b_scales in _group_by_device_and_dtype([params, momenta, scales]).values():
        _descend_(b_params, b_momenta, torch.stack(b_scales), decay)


def _group_by_device_and_dtype(
    tensor_lists: list[list[torch.Tensor]],
) -> dict[tuple[torch.device, torch.dtype], list[list[torch.Tensor]]]:
    """The lists' tensors split by the (device, dtype) of the first list's, each part in the lists' order. Not
    Optimizer._group_tensors_by_device_and_dtype: compiled, that one gives every tensor in one (None, None) part (for
    Inductor to group), and the step reads the dtype it accumulates in from the part's: a compiled float64 step ran
    in float32. Device and dtype are static under Dynamo, so this grouping traces to the same graph either way."""
    parts: dict[tuple[torch.device, torch.dtype], list[list[torch.Tensor]]] = {}
    for i, first in enumerate(tensor_lists[0]):
        part = parts.setdefault((first.device, first.dtype), [[] for _ in tensor_lists])
        for tensors, tensor_list in zip(part, tensor_lists):
            tensors.append(tensor_list[i])
    return parts

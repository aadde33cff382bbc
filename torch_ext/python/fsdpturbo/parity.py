"""Parity gates from an error model: does a run compute what one process computes?

A sharded run (other ranks, other kernels, another instruction set) computes the one-process
result in another order, so in float32 it differs from it by rounding, and by how much depends
on the machine. A gate must accept every correct order on every IEEE machine and still reject
a wrong run. So a run is compared with two one-process references of the same step:

* ref64, the reference in float64 (`float64_mode`: every float32 request of the model code is
  promoted, the top-k routes of the float32 reference are replayed): the exact result up to
  float64 rounding, 2^29 times finer than what is bounded here;
* ref32, the same reference in float32, in one or more orders of the batch's rows: its distance
  from ref64, |ref32 - ref64|, is the rounding a float32 computation of this tensor makes.

Per element i of a tensor T:

    |ours_i - ref64_i| <= C · (max over S(i) and the float32 orders of |ref32 - ref64| + U32 · |ref64_i|)

S(i) is T, or for a stack of experts' tensors (3 or more dims: [experts, ...]) the slice of
i's expert. The first term is the largest rounding error the float32 reference makes in S(i):
it is measured from the summed terms themselves (a gradient that is the small difference of
large terms has a large one), not from the result's magnitude. Per expert because each expert
sums its own tokens' terms: an expert that got few tokens has a gradient, and a rounding, far
below a busy one's, and a fault in that expert alone (a wrong owner, a doubled gradient) must
not hide under the busy expert's rounding. The second is the element's own last
rounding, which any float32 result carries even where the reference happens to be exact (a
scalar loss, say). C = 16: another correct order rounds differently but not worse by more than a
small factor (measured worst 3.4, a compiled model's router gradient, over every gated test and
the demo on three instruction sets: docs/parity.md).
A wrong run — a missing reduction, a doubled gradient, a wrong divide factor — is off by the
order of |ref64| itself, millions of float32 roundings.
"""
import contextlib
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

__all__ = ["C", "U32", "ParityError", "Reference", "Gate", "gate", "float64_mode", "recording_routes"]

C = 16.0
U32 = 2.0 ** -24  # float32's unit roundoff
UNIT_ROUNDOFF = {torch.float32: U32, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


class ParityError(AssertionError):
    """A tensor of the run is outside the error model's bound."""


class _Float64(TorchFunctionMode):
    """Inside: float32 becomes float64 wherever the model code asks for it (dtype arguments,
    `.float()`, float32 tensors it made itself), and `torch.topk` returns the recorded ids of
    `replay` in call order (values gathered from this run's scores), so the float64 reference
    takes the float32 reference's routes even where a near tie would tip the other way."""

    def __init__(self, replay):
        super().__init__()
        self.replay = list(replay) if replay is not None else None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.float:
            func = torch.Tensor.double
        in_place = getattr(func, "__name__", "").endswith("_")
        promoted = tree_map(_promote, (args[1:], kwargs) if in_place else (args, kwargs))
        args, kwargs = ((args[0], *promoted[0]), promoted[1]) if in_place else promoted
        if func in (torch.topk, torch.Tensor.topk) and self.replay is not None:
            if not self.replay:
                raise RuntimeError("float64_mode: more top-k calls than the float32 run recorded")
            ids, scores = self.replay.pop(0), args[0]
            dim = kwargs.get("dim", args[2] if len(args) > 2 else -1)
            fits = list(scores.shape)
            fits[dim] = ids.shape[dim] if ids.dim() == scores.dim() else -1
            if list(ids.shape) != fits:
                raise RuntimeError(f"float64_mode: the recorded top-k ids {tuple(ids.shape)} do not fit the "
                                   f"scores {tuple(scores.shape)} (the two runs took different paths)")
            return torch.return_types.topk((scores.gather(dim, ids), ids))
        return func(*args, **kwargs)


_LOW = (torch.float32, torch.bfloat16, torch.float16)


def _promote(value):
    if value is torch.float32:
        return torch.float64
    if isinstance(value, torch.Tensor) and value.dtype in _LOW:
        return value.double()
    return value


class _Routes(TorchFunctionMode):
    """Records the ids of every `torch.topk` call, in call order."""

    def __init__(self, into):
        super().__init__()
        self.into = into

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.topk, torch.Tensor.topk):
            self.into.append(out[1].detach().clone())
        return out


@contextlib.contextmanager
def recording_routes(into):
    """Appends the ids of every top-k taken inside to the list `into`."""
    with _Routes(into):
        yield into


@contextlib.contextmanager
def float64_mode(replay=None):
    """Runs model code in float64 (default dtype too); with `replay`, top-k takes those ids."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with _Float64(replay):
            yield
    finally:
        torch.set_default_dtype(default)


@dataclass
class _Expected:
    """One tensor's float64 reference and the largest float32 rounding of it (over the tensor,
    or per expert of a stack of experts: shape [experts, 1, ...])."""
    ref64: torch.Tensor
    rounding: torch.Tensor
    unit: float  # the unit roundoff of the run's dtype

    def bound(self, c):
        return c * (self.rounding + self.unit * self.ref64.abs())

    def rounding_at(self, j):
        return self.rounding.expand_as(self.ref64).flatten()[j].item()


def _largest_rounding(error):
    """max |ref32 - ref64| over the tensor, or over each expert's slice of a stack of experts."""
    if not error.numel():
        return torch.zeros((), dtype=torch.float64)
    if error.dim() >= 3:
        return error.amax(dim=tuple(range(1, error.dim())), keepdim=True)
    return error.max()


def _expected(ref64, samples, unit):
    ref64 = ref64.detach().double()
    rounding = torch.stack([_largest_rounding((r.detach().double() - ref64).abs()) for r in samples]).amax(0)
    return _Expected(ref64, rounding, unit)


class Gate:
    """The expected tensors of one step (name → _Expected) and the check of a run against them."""

    def __init__(self, expected, c=C):
        self.expected, self.c = expected, c

    def __contains__(self, name):
        return name in self.expected

    def ratio(self, name, ours):
        """max over elements of |ours - ref64| / bound, and the flat index of that element."""
        e = self.expected[name]
        ours = torch.as_tensor(ours).detach().double().reshape(e.ref64.shape)
        if not e.ref64.numel():
            return 0.0, 0
        ratio = (ours - e.ref64).abs() / e.bound(self.c).clamp_min(torch.finfo(torch.float64).tiny)
        ratio = torch.where(ours == e.ref64, torch.zeros_like(ratio), ratio)  # exact (also 0 = 0)
        ratio = torch.where(torch.isnan(ratio), torch.full_like(ratio, float("inf")), ratio)
        j = int(ratio.argmax())
        return ratio.flatten()[j].item(), j

    def check(self, name, ours, what=""):
        """Raises ParityError naming the tensor, the worst element and the bound unless every
        element of `ours` is within it."""
        e = self.expected[name]
        ours = torch.as_tensor(ours).detach().double()
        label = f"{what} {name}".strip()
        if ours.shape != e.ref64.shape:
            raise ParityError(f"{label}: shape {tuple(ours.shape)}, expected {tuple(e.ref64.shape)}")
        ratio, j = self.ratio(name, ours)
        if ratio > 1:
            index = tuple(int(i) for i in torch.unravel_index(torch.tensor(j), e.ref64.shape)) if e.ref64.dim() else ()
            got, want = ours.flatten()[j].item(), e.ref64.flatten()[j].item()
            out = int(((ours - e.ref64).abs() > e.bound(self.c)).sum())
            raise ParityError(
                f"{label}{list(index) if index else ''} is {got:.9g}, the float64 reference {want:.9g}: "
                f"|diff| {abs(got - want):.3g} > bound {self.c:g} × (reference rounding {e.rounding_at(j):.3g} + "
                f"{e.unit:.3g} × |ref| {e.unit * abs(want):.3g}) = {e.bound(self.c).flatten()[j].item():.3g} "
                f"({out} of {ours.numel()} elements out)")

    def check_all(self, tensors, what=""):
        for name, ours in tensors.items():
            self.check(name, ours, what)


def gate(ref64, samples, dtype=torch.float32, c=C):
    """The Gate of named float64 results `ref64` with the same computation's results in `dtype`,
    one dict per order in `samples` (the same names)."""
    unit = UNIT_ROUNDOFF[dtype]
    return Gate({name: _expected(value, [sample[name] for sample in samples], unit) for name, value in ref64.items()},
                c)


class Reference:
    """The one-process reference of a run: the model in the run's dtype and its float64 twin,
    each with its optimizer, started every step from the run's own parameters.

    `model`: the one-process model (its parameters' names are the run's); `dtype`: the run's
    (float32, or bfloat16 / float16: then the model is cast to it and the bound's unit roundoff
    is that dtype's); `optimizer`: params → torch optimizer, for `optimizer_step`."""

    def __init__(self, model, optimizer=None, dtype=torch.float32):
        import copy

        self.dtype = dtype
        self.model64 = copy.deepcopy(model).double()
        self.model = model.to(dtype)
        for module in self.model64.modules():  # torch's grouped GEMM has no float64: HF's per-expert loop
            if getattr(getattr(module, "config", None), "_experts_implementation", None) is not None:
                module.config._experts_implementation = "eager"
        self.params = dict(model.named_parameters())
        self.params64 = dict(self.model64.named_parameters())
        self.optimizers = (optimizer(list(self.params.values())), optimizer(list(self.params64.values()))) \
            if optimizer else None

    def load(self, params):
        """Both models start from `params` (name → full tensor)."""
        with torch.no_grad():
            for name, value in params.items():
                self.params[name].copy_(value)
                self.params64[name].copy_(value.double())

    def step(self, step_fn, rows=None, orders=None):
        """Runs `step_fn(model, order)` — forward and backward of the step on the whole batch
        with its rows taken in `order` (an index into the batch's rows), returning a dict of
        named scalars (or None) — in float32 once per order, then in float64 with the first
        order and that run's routes. `orders`: the orders to take; `rows`: the batch has that
        many rows, taken as they come and reversed; neither: once, as they come (`slice(None)`).
        Returns a Gate over the scalars and every parameter's gradient (`grad <name>`)."""
        if orders is None:
            orders = [slice(None)] if rows is None else [torch.arange(rows), torch.arange(rows).flip(0)]
        runs, routes = [], []
        for k, order in enumerate(orders):
            self._zero_grad(self.model)
            with recording_routes(routes) if k == 0 else contextlib.nullcontext():
                outputs = step_fn(self.model, order)
            runs.append(self._collect(self.model, outputs))
        self._zero_grad(self.model64)
        with float64_mode(replay=routes):
            run64 = self._collect(self.model64, step_fn(self.model64, orders[0]))
        return gate(run64, runs, self.dtype)

    def optimizer_step(self, grads):
        """Both optimizers step with the run's gradients (name → full tensor); returns a Gate over
        the parameters after the step (`<name>`)."""
        if self.optimizers is None:
            raise ValueError("Reference.optimizer_step: the Reference was made without an optimizer")
        for name, grad in grads.items():
            self.params[name].grad = grad.detach().clone().to(self.params[name].dtype)
            self.params64[name].grad = grad.detach().double()
        for optimizer in self.optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return gate(self.params64, [self.params], self.dtype)

    @staticmethod
    def _zero_grad(model):
        for p in model.parameters():
            p.grad = None

    @staticmethod
    def _collect(model, outputs):
        named = {name: torch.as_tensor(value).detach().clone() for name, value in (outputs or {}).items()}
        named.update({f"grad {n}": (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
                      for n, p in model.named_parameters()})
        return named

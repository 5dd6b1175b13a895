"""Discrete code updates of VPTQ layers during end-to-end distillation: the codes move too, not only the codebooks
(docs/methods.md#discrete-code-updates).

Every ``distill_code_every`` steps, the gradient of each VPTQ layer's weight summed over the steps since the last
update (``CodeLinear``, the trainable form with a gradient tap) is used: for every main vector, the nearest
centroid of its codebook to a proposed weight, the current one moved against the gradient, is searched
(``kmeans.CodebookSearch``):

    t = c_old - eta * s * g      (codebook space; s: the column's ``weight_scale``, 1 without normalisation)
    gain = h s² (||c_old - t||² - ||c_new - t||²)     (the squared distance to the proposal saved, in weight space)

with ``g`` divided by ``h``, the column's share of the diagonal of the layer's Hessian (the mean squared input of
the steps since the last update, relative to the layer's mean): a Newton step on that diagonal, the distance
weighted by it.

``eta`` makes the move relative: ``distill_code_step`` times the codebook's RMS, over the RMS of ``s * g`` of the
layer's vectors; one vector's move is clipped to ``MOVE_CAP`` times the RMS length of a centroid. Of the vectors whose
nearest centroid changed, at most ``distill_code_share`` of the layer's vectors, those with the largest gain, take the
new code; the others keep theirs, so a step never moves much of the model at once. The distance is Euclidean in weight
space (no Hessian), which is what the first-order step plus a proximal term minimises. The residual codes and the
outlier columns stay as they are (a main code's proposal already holds the residual fixed: it cancels out of ``t``), and
so do the vectors of a partial last row (rows past the layer's outputs, whose padding would count in the distance).

The codes follow the held-out checks as the codebooks do: the codes of the kept check are the ones written into
the layer states (``CodeUpdates.finish``), in the states' own index dtype, so the packed format holds them.
"""

from __future__ import annotations

import math

import torch

from vptq_core.kernels.reference import as_index

from .kmeans import CodebookSearch
from .states import VQLayerState
from .trainable import CodebookLinear, code_rows, trainable_linear

# The longest proposed move of one vector, in units of its codebook's RMS x sqrt(vector length) (the RMS length of
# a centroid).
MOVE_CAP = 0.5


class _Tap(torch.autograd.Function):
    """Identity on the weight whose backward hands the weight's gradient to ``layer.take_grad``."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, layer: CodeLinear) -> torch.Tensor:
        ctx.layer = layer
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.layer.take_grad(grad)
        return grad, None


class CodeLinear(CodebookLinear):
    """``CodebookLinear`` whose main codes can change: while ``armed``, the backward keeps the stored-order
    weight's gradient (``grad``); ``propose`` turns it into re-assignments, ``assign`` applies them."""

    def __init__(self, state: VQLayerState, bias=None, device=None) -> None:
        super().__init__(state, bias, device)
        self._codes = self._codes.clone()  # its own: the state keeps the starting codes until ``finish``
        self.armed = False
        self.grad: torch.Tensor | None = None
        self.x_sq: torch.Tensor | None = None  # sum of the squared inputs per stored column while armed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed and torch.is_grad_enabled():
            xs = x.detach().float().reshape(-1, x.shape[-1]).pow(2).sum(0)
            xs = xs if self._perm is None else xs[self._perm]
            self.x_sq = xs if self.x_sq is None else self.x_sq + xs
        return super().forward(x)

    def stored_weight(self) -> torch.Tensor:
        weight = super().stored_weight()
        if self.armed and torch.is_grad_enabled() and weight.requires_grad:
            weight = _Tap.apply(weight, self)
        return weight

    def take_grad(self, grad: torch.Tensor) -> None:
        grad = grad.detach().float()
        self.grad = grad if self.grad is None else self.grad + grad

    def codes(self) -> torch.Tensor:
        """The main codes as codebook rows, int64 [R, G * group_size] (row offsets g * k included)."""
        spec = self.spec
        return code_rows(self._codes, spec.num_centroids).view(spec.rows, spec.group_num * spec.group_size)

    def propose(self, step: float, share: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        """From the kept gradient (then dropped): (flat positions in ``codes()``, their new codebook rows) of the
        vectors to re-assign, at most ``share`` of the layer's vectors; None without a gradient."""
        grad, self.grad = self.grad, None
        x_sq, self.x_sq = self.x_sq, None
        if grad is None:
            return None
        spec = self.spec
        v, k, G, gs = spec.vector_len, spec.num_centroids, spec.group_num, spec.group_size
        full = spec.out_features // v  # whole rows of vectors: a partial last row is left alone
        if full == 0:
            return None
        cols = G * gs
        g = grad[: full * v, spec.outlier_size :]  # main columns, stored order [full*v, cols]
        if "weight_scale" in self.params:
            scale = self.params["weight_scale"].detach()
            scale = (scale if self._perm is None else scale[self._perm])[spec.outlier_size :]
        else:
            scale = torch.ones(cols, device=g.device)
        # the diagonal of the layer's Hessian (the inputs' second moments) per column: the step is Newton's on
        # that diagonal, the distance weighted by it, so columns that see large inputs move little
        h = x_sq[spec.outlier_size :] if x_sq is not None else torch.ones(cols, device=g.device)
        h = (h / h.mean().clamp_min(1e-30)).clamp_min(1e-6)
        g = g.view(full, v, cols).permute(0, 2, 1) * (scale / h).view(1, cols, 1)  # [full, cols, v]: codebook space
        codebook = self.params["centroids"].detach().float().reshape(G * k, v)
        g_rms = float(g.pow(2).mean().sqrt())
        if g_rms == 0.0:
            return None
        cb_rms = float(codebook.pow(2).mean().sqrt())
        move = g * (step * cb_rms / g_rms)  # [full, cols, v]
        # a few vectors' gradients are many times the layer's RMS: unclipped, their proposals land far outside the
        # region the linear step describes, and re-assigning them (they gain most) wrecks the layer
        cap = MOVE_CAP * cb_rms * math.sqrt(v)
        norms = move.norm(dim=-1, keepdim=True)
        move = move * torch.clamp(cap / norms.clamp_min(1e-30), max=1.0)
        old = self.codes()[:full]  # [full, cols]
        target = codebook[old] - move
        new = torch.empty_like(old)
        for group in range(G):
            part = slice(group * gs, (group + 1) * gs)
            search = CodebookSearch(codebook[group * k : (group + 1) * k].contiguous())
            found = search(target[:, part].reshape(-1, v).contiguous())
            new[:, part] = found.view(full, gs) + group * k
        gain = ((codebook[old] - target).pow(2).sum(-1) - (codebook[new] - target).pow(2).sum(-1))
        gain = gain * (scale.pow(2) * h).view(1, cols)
        gain = torch.where((new != old) & (gain > 0), gain, torch.zeros_like(gain)).flatten()
        most = max(1, math.floor(share * self._codes.numel()))
        top = torch.topk(gain, min(most, gain.numel()))
        keep = top.indices[top.values > 0]
        return keep, new.flatten()[keep]

    def assign(self, positions: torch.Tensor, rows: torch.Tensor) -> None:
        """Main codes at flat ``positions`` of ``codes()`` become codebook ``rows``."""
        spec = self.spec
        cols = spec.group_num * spec.group_size
        r, col = positions // cols, positions % cols
        g, c = col // spec.group_size, col % spec.group_size
        # (to int16 wraps 32768..65535 to the uint16 patterns the states keep, as ``vptq.compact_indices``)
        self._codes[g, r, c] = (rows - g * spec.num_centroids).to(self._codes.dtype)

    def state_indices(self) -> torch.Tensor:
        """The current main codes in the state's layout, dtype and device ([G, R, group_size])."""
        ref = self.state.indices
        return self._codes.to(ref.device, ref.dtype).clone()


class CodeUpdates:
    """The discrete side of distillation: arms the taps on the due steps, re-assigns codes after them, and keeps
    the codes of every held-out check that improves, so the kept check's codes are the ones written back."""

    def __init__(self, every: int, share: float, step: float) -> None:
        self.every, self.share, self.step = every, share, step
        self.layers: dict[str, CodeLinear] = {}
        self._steps = 0
        self._checks = 0
        self._best: float | None = None
        self._kept: dict[int, dict[str, torch.Tensor]] = {}
        self.changed = 0  # re-assignments made (a vector may count more than once)

    def linear(self, name: str, state, bias, device) -> torch.nn.Module:
        """The trainable form of ``state``: a ``CodeLinear`` for a VPTQ layer, else the usual one."""
        if not isinstance(state, VQLayerState):
            return trainable_linear(state, bias, device)
        self.layers[name] = layer = CodeLinear(state, bias, device)
        return layer

    def before_step(self) -> None:
        """Before a step's loss: arm the taps (the gradients add up until the next code update: one window's
        gradient alone is noisy)."""
        self._steps += 1
        for layer in self.layers.values():
            layer.armed = True

    def after_step(self) -> None:
        """After a step's update: on a due step, re-assign the codes the gradients since the last update propose."""
        if self._steps % self.every:
            return
        with torch.no_grad():
            for layer in self.layers.values():
                layer.armed = False
                got = layer.propose(self.step, self.share)
                if got is not None and got[0].numel():
                    layer.assign(*got)
                    self.changed += int(got[0].numel())

    def checked(self, value: float) -> None:
        """After a held-out check: keep the codes when it is the first or better than every earlier one (the
        rule of ``train.improves``, which ``train_holdout`` keeps the codebooks by)."""
        if self._best is None or value < self._best:
            self._best = value
            self._kept[self._checks] = {name: layer._codes.clone() for name, layer in self.layers.items()}
        self._checks += 1

    def finish(self, best_index: int) -> int:
        """Put the codes of check ``best_index`` back and write them into the layer states; returns how many main
        codes differ from the start."""
        kept = self._kept[best_index]
        moved = 0
        for name, layer in self.layers.items():
            layer._codes.copy_(kept[name])
            new = layer.state_indices()
            moved += int((as_index(new) != as_index(layer.state.indices)).sum())
            layer.state.indices = new
        return moved

"""Bits where they matter: a per-layer VPTQ plan for a total-bits budget, from measured sensitivity.

The cap allocator (``allocate.py``) gives every layer the same index bits and only shrinks codebooks that are
expensive next to their layer. This one spends the budget where the model's loss feels the error. For a layer
``l`` quantized with settings ``c`` (vector length, codebook size), the loss grows by about

    ΔL_l(c) ≈ ½ · ḡ²_l · E‖ΔW_l x‖²,  E‖ΔW_l x‖² ≈ out_l · ρ_l(c) · σ²_l · Σ_j 1 / U_jj²

* ``ḡ²_l``: the mean squared gradient of the language-model loss with respect to the layer's outputs, per
  token and output (one backward pass of the original model over a few calibration windows);
* ``σ²_l``: the mean square of the layer's weights; ``ρ_l(c)``: the relative mean squared error k-means leaves
  on vectors like the layer's at settings ``c`` (``distortion``: fitted on the layer's own vectors, so a small
  layer with a large codebook is as well served as it really is);
* ``Σ_j 1/U_jj²`` (``U``: upper Cholesky factor of the damped ``H⁻¹`` in the sweep's column order): what the
  sweep's error feedback leaves of unit noise per weight on the layer's inputs (GPTQ's per-column error weight),
  from the layer's Hessian ``H = Σ_t x_t x_tᵀ``.

``allocate`` then solves the multiple-choice knapsack "least Σ ΔL_l within the budget's bits" greedily over each
layer's lower convex hull of (bits, ΔL): every step up a layer's ladder is taken in order of loss saved per bit,
while it fits. Bits are exact (``vptq_layers.config_bits``: codebooks, outliers and permutation included), so the
plan never exceeds the budget.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import time
from collections.abc import Callable

import torch
from torch import nn

from .allocate import resolve_budget
from .block_backward import backward_by_block
from .blocks import block_linears, blocks_prefix, decoder_blocks
from .config import VPTQConfig, layer_settings
from .hessian import SharedInputs, inverse_hessian_cholesky, prepare_hessian
from .kmeans import nearest, weighted_kmeans
from .methods import Cancelled
from .vptq_layers import layer_config

SENSITIVITY_LABELS = "sampled"  # the next tokens whose loss is differentiated (``measure``)
MIN_INDEX_BITS, MAX_INDEX_BITS = 1.0, 4.0  # index bits per weight the ladder spans at least
LADDER_SPAN = 1.5  # ... and this far over the budget
# No layer below the budget's index bits minus this: a plan that let layers go much lower ended worse than the cap
# allocation after distillation (docs/methods.md#bit-plan-by-sensitivity).
LADDER_FLOOR = 1.0
DISTORTION_ITERS = 3  # Lloyd iterations of the distortion table's fits
SHARED_INPUT_LOOKBACK = 8  # linear inputs ``measure`` holds while finding the linears that read the same one


@dataclasses.dataclass
class LayerSensitivity:
    """What ``measure`` found for one linear: ``weight`` · ρ(c) is its predicted loss increase."""

    out_features: int
    in_features: int
    grad_sq: float  # Σ_t ||∂L/∂y_t||² / (tokens · out)
    weight_ms: float  # mean(W²)
    feedback: float  # Σ_j 1/U_jj² / tokens
    weight: float


def ladder(config: VPTQConfig) -> list[tuple[int, int]]:
    """(vector_len, num_centroids) the plan may give a layer: vector lengths 2..config.vector_len + 2, every other
    codebook size from ``config.num_centroids`` entries down to 16, and index bits per weight from
    ``LADDER_FLOOR`` under the budget (at least MIN_INDEX_BITS) up to MAX_INDEX_BITS or ``LADDER_SPAN`` over the
    budget, whichever is more."""
    top = int(math.log2(config.num_centroids))
    budget = config.bits_budget or config.bits_per_index_weight
    lo, hi = max(MIN_INDEX_BITS, budget - LADDER_FLOOR), max(MAX_INDEX_BITS, budget + LADDER_SPAN)
    steps = []
    for v in range(2, config.vector_len + 3):
        for b in range(top, 3, -2):  # every other codebook size: 4096, 1024, 256, ...
            if lo <= b / v <= hi:
                steps.append((v, 2**b))
    return sorted(steps)


class _Gauges:
    """What ``measure`` gathers while the model runs: per linear the summed squared gradient of its outputs, per
    distinct linear input the Hessian Σ x xᵀ (``inputs``: the forward that sees each window's inputs once)."""

    def __init__(self, linears: dict[str, nn.Linear]) -> None:
        self.linears = linears
        self.grad_sq = dict.fromkeys(linears, 0.0)
        self.hessians: dict[str, torch.Tensor] = {}  # first linear reading an input -> Σ x xᵀ
        # linears that share an input (q/k/v, gate/up) read it one after another: decided in the first window,
        # holding only the last few inputs of the whole model's forward
        self.groups = SharedInputs(SHARED_INPUT_LOOKBACK)
        self.inputs = True
        self.feedback: dict[str, float] = {}  # owner -> Σ_j 1/U_jj² per token, once its Hessian is complete

    def hook(self, name: str):
        def hook(_module, args, out):
            x = args[0].detach()
            if self.inputs and self.groups.owner_of(name, x) == name:
                flat = x.reshape(-1, x.shape[-1]).float()
                h = flat.T @ flat
                self.hessians[name] = self.hessians[name] + h if name in self.hessians else h
            if out.requires_grad:
                out.register_hook(lambda g: self.grad_sq.__setitem__(name, self.grad_sq[name]
                                                                     + float(g.float().pow(2).sum())))
        return hook

    def finish_feedback(self, names: list[str], damp_percent: float, tokens: int) -> None:
        """The error feedback of the inputs of ``names`` (their Hessians complete), their Hessians then freed."""
        for name in names:
            key = self.groups.owner[name]
            if key not in self.feedback:
                W = self.linears[name].weight.detach().to(self.hessians[key].device, torch.float32)
                _, Hd = prepare_hessian(W, self.hessians.pop(key), damp_percent)
                perm = torch.argsort(torch.diag(Hd), descending=True, stable=True)
                U = inverse_hessian_cholesky(Hd[perm][:, perm])
                self.feedback[key] = float((1.0 / torch.diag(U).double() ** 2).sum()) / tokens

    def sensitivity(self, name: str, tokens: int) -> LayerSensitivity:
        linear, feedback = self.linears[name], self.feedback[self.groups.owner[name]]
        g = self.grad_sq[name] / (tokens * linear.out_features)
        ms = float(linear.weight.detach().float().double().pow(2).mean())
        return LayerSensitivity(linear.out_features, linear.in_features, g, ms, feedback,
                                0.5 * g * linear.out_features * ms * feedback)


def measure(model: nn.Module, windows: torch.Tensor, damp_percent: float, device: torch.device,
            should_stop: Callable[[], bool] | None = None, labels: str | None = None,
            seed: int = 0, progress: Callable[[int], None] | None = None) -> dict[str, LayerSensitivity]:
    """One forward + backward of ``model`` (the original) over each window of ``windows`` [n, seq] on ``device``,
    per block linear (full module name) its ``LayerSensitivity``. The loss: cross-entropy of each next token
    (``labels`` "data", the gradient's Fisher is the empirical one) or of a token drawn from the model's own
    next-token distribution at each position ("sampled", seeded: the Fisher of the model's own distribution, which
    is what the KL to the original distillation minimises sees); default ``SENSITIVITY_LABELS``.

    The model stays where it is (the original on the CPU, a GPU to work on): its blocks run one at a time on
    ``device``, in float32, as in the block stage (``block_backward``), every window through a block before the
    next. So the measurement holds one block's activations and one block's Hessians whatever the model's depth,
    where one forward and backward of the whole model would hold every block's saved activations and every
    Hessian until the last window (the same numbers: tests). ``progress(b)``: b blocks measured."""
    labels = labels or SENSITIVITY_LABELS
    if labels not in ("data", "sampled"):
        raise ValueError(f"labels must be 'data' or 'sampled', got {labels!r}")
    device = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    should_stop = should_stop or (lambda: False)
    prefix = blocks_prefix(model)
    per_block = [[f"{prefix}.{b}.{n}" for n in block_linears(block)] for b, block in enumerate(decoder_blocks(model))]
    gauges = _Gauges({name: model.get_submodule(name) for names in per_block for name in names})
    tokens = windows.shape[0] * windows.shape[1]

    def loss_of(logits: torch.Tensor, ids: torch.Tensor, start: int) -> torch.Tensor:
        """Positions start.. of a window: their share of its mean next-token cross-entropy."""
        if labels == "data":
            targets = ids[0, start + 1 : start + 1 + logits.shape[0]]
        else:
            with torch.no_grad():
                probs = torch.softmax(logits, dim=-1).cpu()
                targets = torch.multinomial(probs, 1, generator=gen).squeeze(1).to(logits.device)
        ce = torch.nn.functional.cross_entropy(logits, targets, reduction="sum")
        return ce / (ids.shape[1] - 1)

    handles = [m.register_forward_hook(gauges.hook(n)) for n, m in gauges.linears.items()]
    flags = {n: p.requires_grad for n, p in model.named_parameters()}  # by name: a move may swap the objects
    was_training = model.training
    try:
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
        def block_done(b: int) -> None:
            gauges.groups.release()  # every linear of the block has its owner after the first window
            gauges.finish_feedback(per_block[b], damp_percent, tokens)
            if progress is not None:
                progress(b + 1)

        backward_by_block(model, windows, device, loss_of, measuring=lambda on: setattr(gauges, "inputs", on),
                          block_done=block_done, should_stop=should_stop)
    finally:
        gauges.groups.release()
        for h in handles:
            h.remove()
        for n, p in model.named_parameters():
            p.requires_grad_(flags[n])
        model.train(was_training)
    return {name: gauges.sensitivity(name, tokens) for name in gauges.linears}


def distortion(model: nn.Module, steps: dict[tuple[int, int], list[tuple[int, int]]], names: list[str],
               config: VPTQConfig, should_stop: Callable[[], bool] | None = None) -> dict:
    """ρ per layer shape (out, in) and step (v, k) of ``steps[shape]``: the relative mean squared error (error
    over the weights' mean square) k-means leaves on a layer of that shape. Fitted, as the sweep's codebooks are,
    on the layer's own vectors: those of one layer of the shape (the middle one among ``names``), scaled to unit
    RMS."""
    should_stop = should_stop or (lambda: False)
    by_shape: dict[tuple[int, int], list[str]] = {}
    for name in names:
        m = model.get_submodule(name)
        by_shape.setdefault((m.out_features, m.in_features), []).append(name)
    table = {}
    for shape, members in by_shape.items():
        W = model.get_submodule(members[len(members) // 2]).weight.detach().float().cpu()
        W = W / W.pow(2).mean().sqrt().clamp(min=1e-12)
        table[shape] = {}
        for v, k in steps[shape]:
            if should_stop():
                raise Cancelled
            pad = (-W.shape[0]) % v
            vectors = torch.nn.functional.pad(W, (0, 0, 0, pad)).T.reshape(-1, v)
            fit = weighted_kmeans(vectors, None, k, DISTORTION_ITERS, seed=config.seed,
                                  sample=min(config.kmeans_sample, 64 * k))
            err = (vectors - fit.centroids[nearest(vectors, fit.centroids)]).pow(2).sum()
            table[shape][(v, k)] = float(err / vectors.pow(2).sum().clamp(min=1e-12))
    return table


@dataclasses.dataclass
class Plan:
    """A per-layer plan: ``layers`` full module name -> (vector_len, num_centroids); its exact bits."""

    layers: dict[str, tuple[int, int]]
    total_bits: float  # per weight, codebooks, outliers and permutation included
    index_bits: float
    predicted: float  # Σ ΔL_l of the plan


def _hull(options: list[tuple[float, float, tuple[int, int]]]) -> list[tuple[float, float, tuple[int, int]]]:
    """The lower convex hull of (bits, loss, step), ascending in bits, strictly falling in loss."""
    pts = []
    for bits, loss, step in sorted(options):
        if pts and loss >= pts[-1][1]:
            continue  # no better than a cheaper step
        while len(pts) >= 2:
            (b1, l1, _), (b2, l2, _) = pts[-2], pts[-1]
            if (l1 - l2) * (bits - b2) <= (l2 - loss) * (b2 - b1):  # pts[-1] lies on or above the chord
                pts.pop()
            else:
                break
        pts.append((bits, loss, step))
    return pts


def allocate(sens: dict[str, LayerSensitivity], rho: dict, config: VPTQConfig, budget: float,
             bits_of: Callable[[VPTQConfig, int, int], object]) -> Plan:
    """The plan with the least predicted loss whose total bits per weight are <= ``budget`` (greedy over each
    layer's convex hull; every step that saves the most loss per bit, while it fits). ``bits_of``: the method's
    bits of a layer (``vptq.config_bits``). ValueError naming the least the ladder reaches when nothing fits."""
    hulls, weights = {}, {}
    for name, s in sens.items():
        n = s.out_features * s.in_features
        weights[name] = n
        options = []
        for step, r in rho[(s.out_features, s.in_features)].items():
            info = bits_of(layer_settings(config, *step), s.out_features, s.in_features)
            options.append((info.total_bits_per_weight * n, s.weight * r, step))
        hulls[name] = _hull(options)
    total_weights = sum(weights.values())
    limit = budget * total_weights
    at = dict.fromkeys(hulls, 0)
    used = sum(h[0][0] for h in hulls.values())
    if used > limit + 1e-6:
        raise ValueError(f"bits_budget {budget:g} cannot be met by a per-layer plan on this model: the least its "
                         f"ladder reaches is {used / total_weights:.3f} total bits per weight")
    heap = []

    def push(name: str) -> None:
        h, i = hulls[name], at[name]
        if i + 1 < len(h):
            d_bits, d_loss = h[i + 1][0] - h[i][0], h[i][1] - h[i + 1][1]
            heapq.heappush(heap, (-d_loss / d_bits, name, d_bits))

    for name in hulls:
        push(name)
    while heap:
        _, name, d_bits = heapq.heappop(heap)
        if used + d_bits > limit + 1e-6:
            continue  # this layer's next step does not fit: it stays where it is
        used += d_bits
        at[name] += 1
        push(name)
    # what the greedy left: any single layer's move to another hull point that fits and lowers the loss most
    while True:
        best_gain, best_move = 0.0, None
        for name, h in hulls.items():
            here = h[at[name]]
            for j, (bits, loss, _) in enumerate(h):
                if loss < here[1] and used - here[0] + bits <= limit + 1e-6 and here[1] - loss > best_gain:
                    best_gain, best_move = here[1] - loss, (name, j)
        if best_move is None:
            break
        name, j = best_move
        used += hulls[name][j][0] - hulls[name][at[name]][0]
        at[name] = j
    layers = {name: hulls[name][at[name]][2] for name in hulls}
    index = sum(weights[n] * math.log2(layers[n][1]) / layers[n][0] for n in layers) / total_weights
    return Plan(layers, used / total_weights, index, sum(hulls[n][at[n]][1] for n in hulls))


def measured_windows(windows: torch.Tensor, count: int = VPTQConfig.sensitivity_windows) -> torch.Tensor:
    """The ``count`` windows (``sensitivity_windows``) the measurement runs on: spread evenly over ``windows``
    (with self-written calibration, text and self-written windows both)."""
    n = windows.shape[0]
    pick = torch.linspace(0, n - 1, min(count, n)).round().long().unique()
    return windows[pick]


def plan_config(model: nn.Module, windows: torch.Tensor, config: VPTQConfig, device: torch.device,
                bits_of: Callable, should_stop: Callable[[], bool] | None = None,
                progress: Callable[[int], None] | None = None) -> tuple[VPTQConfig, dict]:
    """``config`` with its ``layer_plan`` for ``model`` (measured on ``config.sensitivity_windows`` of ``windows``,
    ``measured_windows``), and metrics
    for the run's report: the plan's bits, how many layers got which settings, each layer's settings and bits, and
    the predicted loss increase of the plan and of the cap allocator's settings for the same budget. ``progress``
    counts one step per block measured, and one for the distortion table."""
    t0 = time.perf_counter()
    measured = measured_windows(windows, config.sensitivity_windows)
    sens = measure(model, measured, config.damp_percent, device, should_stop, seed=config.seed, progress=progress)
    t1 = time.perf_counter()
    shapes = [(s.out_features, s.in_features) for s in sens.values()]
    capped = resolve_budget(dataclasses.replace(config, allocation="cap", layer_bits_cap=0.0), shapes)
    by_cap = {shape: layer_config(capped, *shape) for shape in set(shapes)}
    steps = {shape: sorted(set(ladder(config)) | {(c.vector_len, c.num_centroids)}) for shape, c in by_cap.items()}
    rho = distortion(model, steps, list(sens), config, should_stop)
    if progress is not None:
        progress(len(decoder_blocks(model)) + 1)
    t2 = time.perf_counter()
    plan = allocate(sens, rho, config, config.bits_budget, bits_of)
    cap_loss = sum(s.weight * rho[shape][(by_cap[shape].vector_len, by_cap[shape].num_centroids)]
                   for s, shape in zip(sens.values(), shapes, strict=True))
    counts: dict[str, int] = {}
    for v, k in plan.layers.values():
        counts[f"v{v} k{k}"] = counts.get(f"v{v} k{k}", 0) + 1
    # per layer [name, vector_len, num_centroids, total bits per weight]: the plan as the app and model card show it
    layers = [[name, v, k, bits_of(layer_settings(config, v, k), sens[name].out_features,
                                   sens[name].in_features).total_bits_per_weight]
              for name, (v, k) in plan.layers.items()]
    metrics = {"total_bits": plan.total_bits, "index_bits": plan.index_bits, "predicted_loss": plan.predicted,
               "predicted_loss_cap": cap_loss, "settings": counts, "layers": layers,
               "windows": measured.shape[0], "measure_seconds": t1 - t0,
               "distortion_seconds": t2 - t1}
    layer_plan = tuple((name, v, k) for name, (v, k) in plan.layers.items())
    return dataclasses.replace(config, layer_plan=layer_plan), metrics

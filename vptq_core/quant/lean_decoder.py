"""A lean forward for token-by-token generation with llama-family models (Llama, Qwen2, Mistral): the same
modules and weights as transformers' forward, a fraction of its per-token overhead. The app's chat decodes with
it (batch 1) and calibration sampling writes its windows with it (batch 32).

Per decoder layer, transformers' forward runs some fifty small tensor operations around the seven linears
(RMSNorm as six ops, rotary as a dozen, a cache update, a mask, attention), each costing microseconds of dispatch
on a CPU, and its bf16 attention is several times slower than fp32 on CPUs without bf16 instructions. Here the
linears (nn.Linear, or the quantized modules) are called exactly as the model calls them, and everything between
them is four calls into the native extension (``kernels/csrc/decoder_body.h``): residual add + RMSNorm, attention
fused with the rotary embedding and the KV-cache write, SiLU(gate) * up. Quantized linears on the native kernels
skip their modules: q/k/v run in one native call, gate/up with the SiLU product in another
(``kernels/csrc/shared_input.h``), o and down as their bare C++ layers (the same outputs, see ``LeanDecoder``).
Each step reproduces transformers' rounding to the model dtype (tested against the model's own forward). Without
the extension (no compiler, CUDA tensors) the same steps run as torch operations.

Quantized and original models get the same loop and the same operations between the linears, so a speed
comparison between them measures the linears.
``LeanDecoder.for_model(model)`` returns None (with the reason in ``unsupported_reason``) for anything else; the
decode loop then uses the model's own forward.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

FAMILIES = {"llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral"}
_STATIC_ROPE = {"default", "linear", "llama3", "yarn"}
NATIVE_ATTEND_MAX_TOKENS = 8  # more new tokens at once (a prompt) go through torch's SDPA


def _hooked(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks or getattr(module, "_hf_hook", None))


def unsupported_reason(model: nn.Module, max_len: int | None = None) -> str:
    """Why ``LeanDecoder`` cannot run this model over ``max_len`` tokens ("" when it can)."""
    config = getattr(model, "config", None)
    family = FAMILIES.get(getattr(config, "model_type", None))
    if family is None:
        return f"model type {getattr(config, 'model_type', None)!r} is not one of {sorted(FAMILIES)}"
    inner = getattr(model, "model", None)
    if inner is None or not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")) \
            or not hasattr(model, "lm_head"):
        return "the model does not have the usual model.layers / embed_tokens / norm / rotary_emb / lm_head"
    if model.training:
        return "the model is in training mode"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r} (only silu)"
    if getattr(config, "pretraining_tp", 1) not in (1, None):
        return "pretraining_tp > 1"
    window = getattr(config, "sliding_window", None) if (
        family == "Mistral" or getattr(config, "use_sliding_window", False)) else None
    if window and (max_len is None or max_len > window):
        return f"sliding-window attention ({window} tokens) over a longer sequence ({max_len})"
    rope = getattr(inner.rotary_emb, "rope_type", "default")
    if rope not in _STATIC_ROPE:
        return f"rope type {rope!r} (supported: {sorted(_STATIC_ROPE)})"
    for module in (model, inner, inner.rotary_emb, inner.norm):
        if _hooked(module):
            return f"a forward hook on {type(module).__name__}"
    names = {"layer": f"{family}DecoderLayer", "attn": f"{family}Attention", "mlp": f"{family}MLP",
             "norm": f"{family}RMSNorm"}
    if type(inner.norm).__name__ != names["norm"]:
        return f"final norm is {type(inner.norm).__name__}, not {names['norm']}"
    for i, layer in enumerate(inner.layers):
        parts = {"layer": layer, "attn": getattr(layer, "self_attn", None), "mlp": getattr(layer, "mlp", None),
                 "norm": getattr(layer, "input_layernorm", None)}
        for key, module in parts.items():
            if module is None or type(module).__name__ != names[key]:
                return f"layer {i}: {key} is {type(module).__name__}, not {names[key]}"
        post = getattr(layer, "post_attention_layernorm", None)
        if post is None or type(post).__name__ != names["norm"]:
            return f"layer {i}: post-attention norm is {type(post).__name__}"
        for module in (layer, layer.self_attn, layer.mlp, layer.input_layernorm, post):
            if _hooked(module):
                return f"layer {i}: a forward hook on {type(module).__name__}"
    return ""


def _call_each(linears: tuple, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(f(x) for f in linears)


def _silu_mul_of(ops, gate, up, x: torch.Tensor) -> tuple[torch.Tensor]:  # noqa: ANN001
    return (ops.silu_mul(gate(x), up(x)),)


def _silu_mul_pair(ops, both, x: torch.Tensor) -> tuple[torch.Tensor]:  # noqa: ANN001
    return (ops.silu_mul(*both(x)),)


class _TorchOps:
    """The decoder-step operations as torch ops (transformers' formulas): the fallback of the native ones."""

    name = "torch"

    @staticmethod
    def rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float):  # noqa: ANN205
        h = x if delta is None else x + delta
        h32 = h.to(torch.float32)
        y = weight * (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)
        return [y] if delta is None else [h, y]

    @staticmethod
    def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) * up

    @staticmethod
    def attend(q, k, v, cos, sin, k_cache, v_cache, pos: int, num_heads: int, scale: float):  # noqa: ANN001, ANN205
        b, t = q.shape[:2]
        _, kvh, _, hd = k_cache.shape
        q = q.view(b, t, num_heads, hd).transpose(1, 2)
        k = k.view(b, t, kvh, hd).transpose(1, 2)
        c, s = cos.view(1, 1, t, hd), sin.view(1, 1, t, hd)

        def rope(x: torch.Tensor) -> torch.Tensor:
            half = hd // 2
            return x * c + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * s

        q, k = rope(q), rope(k)
        k_cache[:, :, pos:pos + t] = k
        v_cache[:, :, pos:pos + t] = v.view(b, t, kvh, hd).transpose(1, 2)
        keys, values = k_cache[:, :, :pos + t], v_cache[:, :, :pos + t]
        work = torch.float32 if (q.dtype == torch.bfloat16 and q.device.type == "cpu") else q.dtype
        mask = None
        if t > 1:  # causal over the new tokens, everything before them visible
            mask = torch.ones(t, pos + t, dtype=torch.bool, device=q.device).tril(pos)
        out = F.scaled_dot_product_attention(q.to(work), keys.to(work), values.to(work), attn_mask=mask,
                                             scale=scale, enable_gqa=num_heads != kvh)
        return out.to(q.dtype).transpose(1, 2).reshape(b, t, num_heads * hd)


def _native_layers(modules: tuple[nn.Module, ...], device: torch.device):  # noqa: ANN202
    """The bound native C++ layers of quantized ``modules`` ([(kind, layer, act)], see ``lean_kernel`` of the
    quantized modules), or None unless every one has one, none is hooked and all are of one kind and input
    quantization (so one native call can run them on one shared input)."""
    found = []
    for module in modules:
        lean_kernel = getattr(module, "lean_kernel", None)
        if lean_kernel is None or _hooked(module):
            return None
        try:
            kernel = lean_kernel(device)
        except Exception:  # noqa: BLE001 - a module that cannot bind here: the module's own forward
            return None
        if kernel is None:
            return None
        found.append(kernel)
    if len({(kind, act) for kind, _, act in found}) != 1:
        return None
    return found


def _group_call(ext, modules: tuple[nn.Module, ...], device: torch.device, silu: bool):  # noqa: ANN001, ANN202
    """One native call running ``modules`` on one input: x -> [y, ...] (with ``silu``: [silu(y0) * y1]), or None
    (see ``_native_layers``)."""
    found = _native_layers(modules, device)
    if found is None:
        return None
    kind, _, act = found[0]
    layers = [layer for _, layer, _ in found]
    if kind == "vq":
        return functools.partial(ext.vq_many, layers, silu_mul=silu)
    if act is None:
        return functools.partial(ext.scalar_many, layers, silu_mul=silu)
    mode, bits, step = act
    return functools.partial(ext.scalar_many, layers, silu_mul=silu, act_mode=mode, act_bits=bits, act_scale=step)


def _single_call(module: nn.Module, device: torch.device):  # noqa: ANN202
    """The native C++ layer of one quantized module as a call x -> y (no Python frame in between), or None."""
    found = _native_layers((module,), device)
    if found is None:
        return None
    kind, layer, act = found[0]
    if act is None:
        return layer
    mode, bits, step = act
    return functools.partial(layer.forward_act, mode=mode, bits=bits, scale=step)


def _native_ops():  # noqa: ANN202
    try:
        from vptq_core.kernels import native

        return native.decoder_ops()
    except Exception:  # noqa: BLE001 - no compiler / build failed / disabled: the torch ops
        return None


class LeanDecoder:
    """Prefill + decode steps of a llama-family causal LM with a preallocated KV cache.

    ``prefill(ids)`` ([batch, n]) starts ``batch`` sequences of equal length (1 for a chat) and returns the last
    position's logits [batch, vocab]; ``step(tokens)`` ([batch, 1]) appends one token to each and returns their
    logits. ``ops`` "auto" (native where the model is on the CPU in bf16 / fp32 and the
    extension builds, else torch), "native" or "torch". ``params`` ({parameter name: tensor}, e.g. bf16 copies)
    replaces the weights of plain nn.Linear / nn.Embedding modules and of the norms, as
    ``torch.func.functional_call`` would; the model itself is not changed.
    """

    def __init__(self, model: nn.Module, max_len: int, ops: str = "auto", batch: int = 1,
                 params: dict[str, torch.Tensor] | None = None) -> None:
        reason = unsupported_reason(model, max_len)
        if reason:
            raise ValueError(f"the lean decoder cannot run this model: {reason}")
        if ops not in ("auto", "native", "torch"):
            raise ValueError(f"ops must be 'auto', 'native' or 'torch', got {ops!r}")
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        inner = model.model
        config = model.config
        self.model = model
        # overrides by the identity of the parameter they replace (tied weights share one)
        by_id = {id(p): params[n] for n, p in model.named_parameters(remove_duplicate=False) if n in (params or {})}

        def weight(module: nn.Module, attr: str = "weight") -> torch.Tensor | None:
            t = getattr(module, attr, None)
            return None if t is None else by_id.get(id(t), t)

        def linear(module: nn.Module):  # noqa: ANN202 - the module itself, or F.linear on overridden weights
            if type(module) is nn.Linear and id(module.weight) in by_id:
                return functools.partial(F.linear, weight=weight(module), bias=weight(module, "bias"))
            return module

        embed = inner.embed_tokens
        if type(embed) is nn.Embedding and id(embed.weight) in by_id:
            self.embed = functools.partial(F.embedding, weight=weight(embed))
        else:
            self.embed = embed
        self.head = linear(model.lm_head)
        self.final_weight, self.final_eps = weight(inner.norm), float(inner.norm.variance_epsilon)
        self.dtype, self.device = self.final_weight.dtype, self.final_weight.device
        self.max_len, self.batch = int(max_len), int(batch)
        if self.max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {max_len}")
        native = None
        if ops != "torch" and self.device.type == "cpu" and self.dtype in (torch.bfloat16, torch.float32):
            native = _native_ops()
        if ops == "native" and native is None:
            raise RuntimeError("the native decoder operations are unavailable (CPU bf16/fp32 model and a built "
                               "extension needed)")
        self.ops = native if native is not None else _TorchOps
        self.ops_name = "native" if native is not None else "torch"
        # Per layer: (norm weight, eps, qkv: x -> (q, k, v), o, norm weight, eps, gate_up: x -> (silu(gate) * up,),
        # down, scale). ``plain_layers`` calls the modules one by one; ``layers`` runs quantized modules that share an
        # input in one native call (q/k/v, gate/up; see ``kernels/csrc/shared_input.h``) and the others as their
        # bare C++ layers: the same outputs, without autograd (with autograd on, the plain ones run).
        self.plain_layers, self.layers = [], []
        silu_ops = native if native is not None else _TorchOps
        ext = native
        if ext is None and self.device.type == "cpu" and any(hasattr(m, "lean_kernel") for m in model.modules()):
            ext = _native_ops()  # quantized linears on the native kernels, the rest in torch ops
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            q, k, v, o = (linear(m) for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj))
            gate, up, down = (linear(m) for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
            norms = (weight(layer.input_layernorm), float(layer.input_layernorm.variance_epsilon),
                     weight(layer.post_attention_layernorm), float(layer.post_attention_layernorm.variance_epsilon))
            plain_qkv = functools.partial(_call_each, (q, k, v))
            plain_gate_up = functools.partial(_silu_mul_of, silu_ops, gate, up)
            self.plain_layers.append((norms[0], norms[1], plain_qkv, o, norms[2], norms[3], plain_gate_up, down,
                                      float(attn.scaling)))
            fast = list(self.plain_layers[-1])
            if ext is not None:
                fast[2] = _group_call(ext, (attn.q_proj, attn.k_proj, attn.v_proj), self.device, False) or fast[2]
                fast[3] = _single_call(attn.o_proj, self.device) or fast[3]
                if native is not None:
                    fast[6] = _group_call(ext, (mlp.gate_proj, mlp.up_proj), self.device, True) or fast[6]
                else:
                    both = _group_call(ext, (mlp.gate_proj, mlp.up_proj), self.device, False)
                    fast[6] = functools.partial(_silu_mul_pair, silu_ops, both) if both else fast[6]
                fast[7] = _single_call(mlp.down_proj, self.device) or fast[7]
            self.layers.append(tuple(fast))
        self.fused = sum(a is not b for fast, plain in zip(self.layers, self.plain_layers)
                         for a, b in zip(fast, plain))  # calls replaced (for tests and benchmarks)
        self.num_heads = int(config.num_attention_heads)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or self.num_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.num_heads)
        shape = (self.batch, self.kv_heads, self.max_len, self.head_dim)
        self.k_cache = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        self.v_cache = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        with torch.no_grad():
            positions = torch.arange(self.max_len, device=self.device)[None]
            probe = torch.zeros(1, 1, 1, dtype=self.dtype, device=self.device)
            cos, sin = inner.rotary_emb(probe, positions)
        self.cos, self.sin = cos[0].contiguous(), sin[0].contiguous()
        self.pos = 0

    @classmethod
    def for_model(cls, model: nn.Module, max_len: int, ops: str = "auto", batch: int = 1,
                  params: dict[str, torch.Tensor] | None = None) -> LeanDecoder | None:
        """A decoder for ``model``, or None when it is not supported (see ``unsupported_reason``)."""
        return None if unsupported_reason(model, max_len) else cls(model, max_len, ops, batch, params)

    def _forward(self, ids: torch.Tensor, last_only: bool) -> torch.Tensor:
        t = ids.shape[1]
        if self.pos + t > self.max_len:
            raise ValueError(f"{self.pos + t} tokens do not fit the cache of {self.max_len}")
        ops, pos = self.ops, self.pos
        # a few tokens: the fused native attention; a prompt: torch's SDPA (a GEMM-based kernel, many threads)
        attend = ops.attend if t <= NATIVE_ATTEND_MAX_TOKENS else _TorchOps.attend
        cos, sin = self.cos[pos:pos + t], self.sin[pos:pos + t]
        x = self.embed(ids)
        delta = None
        layers = self.plain_layers if torch.is_grad_enabled() else self.layers
        for i, (w1, e1, qkv, o, w2, e2, gate_up, down, scale) in enumerate(layers):
            hn = ops.rms_norm(x, delta, w1, e1)
            if delta is not None:
                x, hn = hn
            else:
                hn = hn[0]
            q, k, v = qkv(hn)
            a = attend(q, k, v, cos, sin, self.k_cache[i], self.v_cache[i], pos, self.num_heads, scale)
            x, hn = ops.rms_norm(x, o(a), w2, e2)
            (h,) = gate_up(hn)
            delta = down(h)
        if last_only and t > 1:
            x, delta = x[:, -1:], delta[:, -1:]
        _, h = ops.rms_norm(x, delta, self.final_weight, self.final_eps)
        self.pos += t
        logits = self.head(h)
        return logits[:, -1] if last_only else logits

    def prefill(self, ids: torch.Tensor, all_positions: bool = False) -> torch.Tensor:
        """Start new sequences with ``ids`` [batch, n]; the last position's logits [batch, vocab], or with
        ``all_positions`` every position's [batch, n, vocab]."""
        if ids.dim() != 2 or ids.shape[0] != self.batch or ids.shape[1] == 0:
            raise ValueError(f"ids must be [{self.batch}, tokens] with tokens >= 1, got shape {tuple(ids.shape)}")
        self.pos = 0
        return self._forward(ids, last_only=not all_positions)

    def keep_rows(self, rows: int) -> None:
        """Go on with the first ``rows`` sequences only (1 <= rows <= batch): the others' cache is dropped."""
        if not 1 <= rows <= self.batch:
            raise ValueError(f"rows must be 1..{self.batch}, got {rows}")
        self.k_cache = [c[:rows] for c in self.k_cache]
        self.v_cache = [c[:rows] for c in self.v_cache]
        self.batch = int(rows)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append one token per sequence (``tokens`` [batch, 1]); their logits [batch, vocab]."""
        return self._forward(tokens.view(self.batch, 1), last_only=True)

"""Rotating a model's residual stream before quantization (``rotate`` setting; docs/methods.md, "Rotation").

Every norm before a linear is folded into the linears it feeds, and the residual stream is turned by one random
orthogonal matrix ``Q`` (``d × d``, ``d`` the hidden size), so that each token's hidden state ``h`` becomes ``hQ``:

* the embedding ``E → EQ``; the linears that read the stream (q/k/v, gate/up) ``W → (W · diag(g)) Q``, with ``g``
  the weight of the norm before them, which becomes all ones; the linears that write it (o, down) ``W → QᵀW``
  (a bias ``b → bQ``); the LM head ``W → (W · diag(g_final)) Q``, so it no longer equals the embedding and is
  stored on its own (the config says ``tie_word_embeddings: false``).

An RMS norm without its weight commutes with ``Q`` (``‖hQ‖ = ‖h‖``), so the rotated model computes the same
function in exact arithmetic (a test checks the logits). What changes is what the quantizer sees: the inputs of
q/k/v and gate/up, and the outputs of o and down, no longer have channels that carry hundreds of times the mean
energy, which is what a per-group 4-bit grid and an 8-bit per-token activation grid handle worst. The result is a
plain checkpoint of the same family: nothing changes at load or decode time.

A model stored as safetensors is rewritten tensor by tensor into a cached dense directory (``rotated_dir``),
which the run then streams like any other; a model built in code is rotated in memory (``rotate_model_``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from torch import nn

from .embedding import untie_head

# Families whose every norm sits right before the linears it feeds (pre-norm blocks with RMS norms and a final norm
# before the head). Gemma 3 normalises the attention and MLP outputs before adding them to the stream, and those
# norms' weights act in the rotated basis, where they cannot be folded.
ROTATABLE = ("llama", "mistral", "qwen2", "qwen3")
ROTATION_FORMAT = 1  # bumped when the rewrite changes, so that cached directories of an older one are not reused

_BLOCK = re.compile(r"^(?P<prefix>.*\.layers\.\d+\.)(?P<rest>.+)$")
_READS = {**dict.fromkeys(("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
                          "input_layernorm.weight"),
          **dict.fromkeys(("mlp.gate_proj.weight", "mlp.up_proj.weight"), "post_attention_layernorm.weight")}
_WRITES = ("self_attn.o_proj.", "mlp.down_proj.")
_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight")
EMBED, HEAD, FINAL_NORM = "model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"


def check_rotatable(family: str | None) -> None:
    """Refuse, by name, a model family whose residual stream cannot be rotated without changing what it computes."""
    if family not in ROTATABLE:
        raise ValueError(f"rotate: the residual stream of a {family!r} model cannot be rotated (it can for "
                         f"{', '.join(ROTATABLE)}; gemma3 normalises the attention and MLP outputs in the rotated "
                         "basis)")


def rotates(mode: bool | str, family: str | None) -> bool:
    """Whether a run with ``rotate=mode`` rotates a model of ``family``: "auto" where the family allows, True
    always (refusing a family it cannot rotate), False never."""
    if mode is True:
        check_rotatable(family)
        return True
    return mode == "auto" and family in ROTATABLE


def random_orthogonal(n: int, seed: int) -> torch.Tensor:
    """A random orthogonal ``n × n`` matrix (float64), uniform over the orthogonal group (QR of a Gaussian matrix
    with the signs of R's diagonal taken out), the same for the same seed on every machine."""
    gen = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))


def rotated_tensors(names: Iterable[str], get: Callable[[str], torch.Tensor], rotation: torch.Tensor,
                    tied: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, rotated tensor) of every tensor of a model, in its stored dtype, from ``get(name)``; with ``tied``
    the LM head is made from the embedding. Names are Hugging Face's (``model.layers.N.self_attn.q_proj.weight``).
    """
    q = rotation
    names = list(names)
    if tied and HEAD not in names:
        names.append(HEAD)

    def f64(name: str) -> torch.Tensor:
        return get(name).to(torch.float64)

    for name in names:
        source = get(EMBED if tied and name == HEAD else name)  # each tensor read once, plus the norms it folds
        x = source.to(torch.float64)
        block = _BLOCK.match(name)
        rest = block["rest"] if block else ""
        if name == EMBED or (rest.startswith(_WRITES) and rest.endswith(".bias")):
            out = x @ q
        elif name == HEAD:
            out = (x * f64(FINAL_NORM)) @ q
        elif name == FINAL_NORM or rest in _NORMS:
            out = torch.ones_like(x)
        elif rest in _READS:
            out = (x * f64(block["prefix"] + _READS[rest])) @ q
        elif rest.startswith(_WRITES) and rest.endswith(".weight"):
            out = q.T @ x
        else:
            yield name, source
            continue
        yield name, out.to(source.dtype)


def _check_names(names: set[str], tied: bool) -> None:
    """Refuse a checkpoint whose tensors are not named as the rewrite expects (nothing would be rotated)."""
    needed = {EMBED, FINAL_NORM} | (set() if tied else {HEAD})
    missing = sorted(needed - names)
    reads = [n for n in names if (m := _BLOCK.match(n)) and m["rest"] in _READS]
    if missing or not reads:
        raise ValueError(f"rotate: the model's tensors are not named as a {'/'.join(ROTATABLE)} model's "
                         f"(missing {missing or 'the q/k/v and gate/up weights'})")


@torch.no_grad()
def rotate_model_(model: nn.Module, seed: int) -> nn.Module:
    """Rotate a model held in memory, in place (see the module docstring); its head is untied."""
    config = model.config
    check_rotatable(getattr(config, "model_type", None))
    state = model.state_dict()
    tied = bool(getattr(config, "tie_word_embeddings", False))
    _check_names(set(state), tied)
    new = dict(rotated_tensors(state, lambda n: state[n].detach(), random_orthogonal(config.hidden_size, seed),
                               tied))
    if tied:
        untie_head(model, new.pop(HEAD).clone())
    for name, tensor in model.state_dict().items():
        if name in new:
            tensor.copy_(new[name])
    return model


def rotated_dir(directory: str | Path, seed: int, cache: Path) -> Path:
    """The dense safetensors directory of ``directory``'s model rotated with ``seed`` (see the module docstring),
    written under ``cache`` once: tensor by tensor, so memory holds one tensor, and shards of the source's sizes.
    Every other file (config, tokenizer, chat template) is copied; the config says the head is not tied."""
    from .source import SafetensorsWeights

    directory = Path(directory)
    config = json.loads((directory / "config.json").read_text())
    check_rotatable(config.get("model_type"))
    weights = SafetensorsWeights(directory)
    key = json.dumps({"files": weights.fingerprint(), "seed": seed, "format": ROTATION_FORMAT}, sort_keys=True)
    out = cache / f"{directory.name}-rot{seed}-{hashlib.sha1(key.encode()).hexdigest()[:12]}"
    if (out / "config.json").is_file():
        return out
    tied = bool(config.get("tie_word_embeddings", False))
    names = weights.keys()
    _check_names(set(names), tied)
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")  # each process its own: ranks may write at once
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    _write_rotated(weights, sorted(names), tmp, random_orthogonal(int(config["hidden_size"]), seed), tied)
    for item in directory.iterdir():
        if item.is_file() and not item.name.endswith(".safetensors") and item.name not in (
                "config.json", "model.safetensors.index.json"):
            shutil.copy2(item, tmp / item.name)
    config["tie_word_embeddings"] = False
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    try:
        tmp.rename(out)
    except OSError:  # another process finished the same copy first
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / "config.json").is_file():
            raise
    return out


SHARD_BYTES = 2 << 30  # the rotated copy's shard size: a shard is written as soon as it is full


def _write_rotated(weights, names: list[str], out: Path, rotation: torch.Tensor, tied: bool) -> None:
    from safetensors.torch import save_file

    shard: dict[str, torch.Tensor] = {}
    files: list[list[str]] = []

    def flush() -> None:
        file = f"model-{len(files) + 1:05d}.safetensors"
        save_file(shard, str(out / file), metadata={"format": "pt"})
        files.append(list(shard))
        shard.clear()

    size = 0
    with weights.reading():
        for name, tensor in rotated_tensors(names, weights.get, rotation, tied):
            nbytes = tensor.numel() * tensor.element_size()
            if shard and size + nbytes > SHARD_BYTES:
                flush()
                size = 0
            shard[name] = tensor.contiguous()
            size += nbytes
    flush()
    if len(files) == 1:
        (out / "model-00001.safetensors").rename(out / "model.safetensors")
        return
    weight_map = {name: f"model-{i + 1:05d}.safetensors" for i, group in enumerate(files) for name in group}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map},
                                                                 indent=2))

"""``model.generate`` through the lean decoder, wherever that gives transformers' own result.

``enable(model)`` gives the model (an instance the project built: ``load_quantized``, ``load_model``) a
``generate`` of its own, as transformers itself installs a repository's ``custom_generate/generate.py``: an
instance attribute that calls the class's ``generate`` unchanged. When the call is batch-1 greedy or sampled
decoding of a llama-family model (``lean_decoder.unsupported_reason``), it passes ``custom_generate=`` a decoding
method of the shape transformers documents for callables, so transformers still prepares everything (generation
config, logits processors, stopping criteria, lengths, the streamer's prompt) and only the token loop is this
module's: one ``LeanDecoder`` forward per token, the prepared logits processors and stopping criteria applied
to the same ids in the same order as ``GenerationMixin._sample``, the same float32 scores, softmax and
``torch.multinomial`` draw, so the random numbers are consumed the same way and a seeded sampled reply equals
transformers' own. Everything else (beams, assisted decoding, ``return_dict_in_generate`` / ``output_*``, a
padded batch, a cache passed in, a model the lean decoder cannot run) goes to transformers' own loop.
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch import nn
from transformers import GenerationMixin
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.utils import GENERATION_MODES_MAPPING

from .lean_decoder import LeanDecoder, unsupported_reason

_LEAN_MODES = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE)
# generation settings (argument or generation_config field) under which generate() picks another decoding method,
# or returns more than the ids: the call then goes to transformers unchanged
_OTHER_METHODS = {"num_beams": 1, "num_beam_groups": 1, "penalty_alpha": None, "dola_layers": None,
                  "constraints": None, "force_words_ids": None, "prompt_lookup_num_tokens": None,
                  "assistant_early_exit": None, "return_dict_in_generate": False}
# (generate() hands a custom_generate callable neither the tokenizer nor the streamer, so the stop strings that
# need the tokenizer stay with transformers' loop; the streamer is passed along by ``generate`` below)
_OTHER_ARGUMENTS = ("assistant_model", "custom_generate", "past_key_values", "inputs_embeds", "synced_gpus",
                    "negative_prompt_ids", "tokenizer", "assistant_tokenizer", "stop_strings")


class LeanGenerate:
    """The ``generate`` of a model given by ``enable``: the class's ``generate`` with the lean token loop."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __call__(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN204 - generate()'s own signature
        return generate(self.model, *args, **kwargs)


def enable(model: nn.Module) -> nn.Module:
    """Make ``model.generate`` run the lean loop where it applies (see the module docstring); returns ``model``.
    Models that do not generate (no ``GenerationMixin``) are returned unchanged; calling it twice is harmless."""
    if isinstance(model, GenerationMixin) and not isinstance(model.__dict__.get("generate"), LeanGenerate):
        model.generate = LeanGenerate(model)
    return model


def enabled(model: nn.Module) -> bool:
    return isinstance(getattr(model, "__dict__", {}).get("generate"), LeanGenerate)


def wants_lean(model: nn.Module, args: tuple, kwargs: dict) -> bool:
    """A cheap look at the arguments: False when they certainly ask for something other than batch-1 greedy or
    sampled decoding (the decoding method itself checks the prepared settings again)."""
    if any(kwargs.get(name) is not None for name in _OTHER_ARGUMENTS):
        return False
    base = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    for name, plain in _OTHER_METHODS.items():
        value = kwargs[name] if name in kwargs else getattr(base, name, plain)
        if value not in (plain, None):
            return False
    ids = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids"))
    return isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[0] == 1 and not unsupported_reason(model)


def generate(model: nn.Module, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201 - generate()'s own signature
    """``type(model).generate(model, *args, **kwargs)``, with the lean token loop where it applies."""
    method = type(model).generate
    if not wants_lean(model, args, kwargs):
        return method(model, *args, **kwargs)
    return method(model, *args, custom_generate=functools.partial(lean_decoding, streamer=kwargs.get("streamer")),
                  **kwargs)


def _transformers_loop(model, input_ids, logits_processor, stopping_criteria, generation_config,  # noqa: ANN001, ANN201
                       streamer, model_kwargs):
    """The decoding method generate() would have run itself for these prepared settings."""
    name = GENERATION_MODES_MAPPING[generation_config.get_generation_mode()]
    if "/" in name:  # a method that lives in a hub repository: wants_lean keeps such settings away
        raise ValueError(f"generation settings ask for {name}; call generate with custom_generate={name!r}")
    method = getattr(type(model), name)
    extra = {"streamer": streamer} if "streamer" in inspect.signature(method).parameters else {}
    return method(model, input_ids, logits_processor=logits_processor, stopping_criteria=stopping_criteria,
                  generation_config=generation_config, **extra, **model_kwargs)


def _lean_reason(model: nn.Module, input_ids: torch.Tensor, generation_config, model_kwargs: dict) -> str:  # noqa: ANN001
    """Why the prepared call cannot run the lean loop ("" when it can)."""
    if generation_config.get_generation_mode() not in _LEAN_MODES:
        return "decoding method"
    if input_ids.shape[0] != 1:
        return "batch"
    if generation_config.return_dict_in_generate or any(
            getattr(generation_config, f"output_{what}", False) for what in ("scores", "logits", "attentions",
                                                                              "hidden_states")):
        return "extra outputs"
    if model_kwargs.get("attention_mask") is not None:  # generate() drops an all-ones mask
        return "padding"
    cache = model_kwargs.get("past_key_values")
    if cache is not None and (getattr(cache, "_is_user_defined", False) or cache.get_seq_length() > 0):
        return "a cache passed in"
    if set(model_kwargs) - {"attention_mask", "position_ids", "past_key_values", "use_cache", "logits_to_keep",
                            "cache_position"}:
        return "model arguments"
    return unsupported_reason(model, int(generation_config.max_length))


def lean_decoding(model: nn.Module, input_ids: torch.Tensor, logits_processor, stopping_criteria,  # noqa: ANN001
                  generation_config, synced_gpus: bool = False, streamer=None,  # noqa: ANN001
                  **model_kwargs) -> torch.Tensor:
    """A ``custom_generate`` callable: ``GenerationMixin._sample``'s loop over ``LeanDecoder`` forwards (prompt and
    new ids [1, n + new]); settings it does not cover go to the method generate() would have used."""
    if synced_gpus or _lean_reason(model, input_ids, generation_config, model_kwargs):
        return _transformers_loop(model, input_ids, logits_processor, stopping_criteria, generation_config,
                                  streamer, {"synced_gpus": synced_gpus, **model_kwargs})
    n = input_ids.shape[1]
    max_len = max(int(generation_config.max_length), n + 1)
    sample = bool(generation_config.do_sample)
    with torch.inference_mode():
        lean = LeanDecoder(model, max_len)
        ids = torch.empty(1, max_len, dtype=input_ids.dtype, device=input_ids.device)
        ids[:, :n] = input_ids
        length = n
        logits = lean.prefill(input_ids)
        while True:
            scores = logits.to(copy=True, dtype=torch.float32)
            if len(logits_processor):
                scores = logits_processor(ids[:, :length], scores)
            if sample:
                token = torch.multinomial(nn.functional.softmax(scores, dim=-1), num_samples=1).squeeze(1)
            else:
                token = torch.argmax(scores, dim=-1)
            ids[:, length] = token
            length += 1
            done = bool(stopping_criteria(ids[:, :length], None).all()) or length >= max_len
            if streamer is not None:
                streamer.put(token.cpu())
            if done:
                break
            logits = lean.step(token.view(1, 1))
    if streamer is not None:
        streamer.end()
    return ids[:, :length].clone()

"""Command line: ``python -m vptq_core quantize|eval|chat|diff|bench|export-gguf|tasks``.

Bad input exits with code 2 and one line saying what is wrong and what is allowed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .data import DEFAULT_EVAL_SPLIT, EVAL_SPLITS, TEXTS
from .divergence_cli import add_diff_parser, cmd_diff
from .quant import methods
from .quant.config import CALIB_GROUP, GROUPS, CalibConfig
from .quant.settings import Setting, flag_word, grouped, parse_assignment

DESCRIPTION = "Extreme low-bit quantization of LLMs (VPTQ, LRQ, GPTQ, RTN)."


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit code 2
        self.exit(2, f"{self.prog}: error: {message}\n")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except ``None`` ones (their help says what the method's default is)."""

    def _get_help_string(self, action):
        if action.default is None or action.default == []:
            return action.help
        return super()._get_help_string(action)


def _defaults_text(setting: str) -> str:
    """"default X" from every built-in method whose config has ``setting`` (the flags' help)."""
    found = {}
    for method in methods.all_methods():
        if setting in method.setting_names:
            value = getattr(method.config_class(), setting)
            found.setdefault(repr(value) if isinstance(value, str) else str(value), []).append(method.name)
    if not found:
        return ""
    if len(found) == 1:
        return f" (default {next(iter(found))})"
    return " (default " + "; ".join(f"{', '.join(names)}: {value}" for value, names in found.items()) + ")"


def setting_flags() -> dict[str, dict[str, Setting]]:
    """The settings the command line has flags for, by group (``Setting.group``): every registered method's
    config's settings declared with a group (quant/settings.py), in the order --help shows them."""
    return grouped((m.config_class for m in methods.all_methods()), "cli", GROUPS)


def _add_setting_flag(group, name: str, setting: Setting) -> None:
    text = (setting.cli_help + _defaults_text(name)).replace("%", "%%")  # argparse formats help with %
    if setting.kind == "bool" and setting.switch is None:
        group.add_argument(setting.flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=text)
    elif setting.kind == "bool":
        group.add_argument(setting.flag, dest=name, action="store_const", const=setting.switch, default=None,
                           help=text)
    elif setting.kind == "choice" and all(isinstance(c, str) for c in setting.choices):
        group.add_argument(setting.flag, dest=name, choices=list(setting.choices), help=text)
    elif setting.kind == "choice" and any(isinstance(c, bool) for c in setting.choices):
        words = {flag_word(c): c for c in setting.choices}
        group.add_argument(setting.flag, dest=name, type=_choice_word(words), metavar="{" + ",".join(words) + "}",
                           help=text)
    else:  # numbers, and choices of numbers (the config names the allowed ones)
        kind = type(setting.choices[0]) if setting.kind == "choice" else _FLAG_TYPES[setting.kind]
        group.add_argument(setting.flag, dest=name, type=kind, help=text)


_FLAG_TYPES = {"int": int, "pow2": int, "float": float, "text": str}


def _choice_word(words: dict):
    """The flag type of a choice that mixes bools and words (``true``, ``false``, ``auto``): the word's value."""
    def parse(text: str):
        if text not in words:
            raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(words)}")
        return words[text]
    return parse


HEAD_BITS_CHOICES = ["auto", "0", "4", "8"]
HEAD_BITS_HELP = ("a quantized checkpoint's LM head, when stored in the model dtype, runs at this many bits "
                  "(round-to-nearest at load, groups of 128): auto = 8 on the CPU for a large head, 0 = as stored")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m vptq_core", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    q = sub.add_parser("quantize", help="quantize a model and write a packed checkpoint",
                       formatter_class=_HelpFormatter)
    q.add_argument("--model", required=True, help="smollm2-135m-instruct | tiny-random-llama | DIR | hub id")
    q.add_argument("--method", required=True, choices=list(methods.names()),
                   help="; ".join(f"{m.name}: {m.description}" for m in methods.all_methods()))
    q.add_argument("--out", required=True, help="output directory for the checkpoint")
    q.add_argument("--preset", help="a preset of the method, by name or bits: 2.5, 3.5 or 4.5 for the built-in ones "
                   "(TOTAL bits per weight, codebooks and scales included, on any model); explicit flags override it. "
                   "Presets: " + "; ".join(f"{m.name}: {', '.join(m.presets)}" for m in methods.all_methods()
                                           if m.presets))
    arg_groups = {}
    for group_name, settings in setting_flags().items():
        arg_groups[group_name] = q.add_argument_group(group_name)
        for name, setting in settings.items():
            _add_setting_flag(arg_groups[group_name], name, setting)
    q.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", dest="extra_settings",
                   help="any other setting of the method's config, VALUE as JSON (e.g. --set damp_percent=0.05)")
    c = arg_groups.get(CALIB_GROUP) or q.add_argument_group(CALIB_GROUP)
    c.add_argument("--calib-text", default="wiki", help="'wiki' (bundled Wikipedia), 'pydocs' (Python's docs) or a "
                   "UTF-8 text file")
    c.add_argument("--calib-samples", type=_positive, default=32, help="random calibration windows")
    c.add_argument("--seqlen", type=_positive, default=512, help="tokens per calibration window")
    q.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--threads", type=_positive, help="torch CPU threads (default: all cores)")
    q.add_argument("--eval", action="store_true", help="evaluate against the original after quantizing")
    q.add_argument("--resume", action="store_true", help="continue the interrupted run in OUT/.partial from its last "
                   "finished block (same model, method, settings and calibration, or it is refused)")
    q.add_argument("--stream", action=argparse.BooleanOptionalAction, default=None,
                   help="read each block from the model's safetensors files when it is quantized (bounded memory); "
                   "default: whenever the model is a safetensors directory, --no-stream loads it whole")
    q.add_argument("--quantize-head", action="store_true", help="also quantize the LM head, same method and "
                   "settings, its Hessian from its own calibration inputs (a tied head is untied, or shared with "
                   "--quantize-embedding); the head is the most sensitive matrix: at 2-3 bits it alone costs more "
                   "perplexity than all the blocks, while loading keeps a stored head at 8 bits nearly for free "
                   "(eval/chat --head-bits)")
    q.add_argument("--quantize-embedding", action="store_true", help="also quantize the input embedding (tied "
                   "weights: one quantized matrix serves the head and the embedding); loads with load_quantized")
    q.add_argument("--quiet", action="store_true", help="no progress bar")

    e = sub.add_parser("eval", help="perplexity (and KL / top-1 agreement vs the original)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    e.add_argument("--model", required=True, help="model name or directory (dense or quantized checkpoint)")
    e.add_argument("--reference", default="auto",
                   help="original model to compare with: 'auto' = the checkpoint's source model, 'none', or a name/DIR")
    e.add_argument("--text", default="wiki", help="'wiki' or 'pydocs' (bundled, held-out split) or a UTF-8 "
                   "text file (used whole)")
    e.add_argument("--split", choices=EVAL_SPLITS, default=DEFAULT_EVAL_SPLIT,
                   help="held-out split of a bundled text: 'test' to report, 'dev' to choose settings, 'eval' both")
    e.add_argument("--seqlen", type=_positive, default=512)
    e.add_argument("--max-windows", type=_positive, default=None)
    e.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="dense model dtype")
    e.add_argument("--json", action="store_true", help="print one JSON object")
    e.add_argument("--threads", type=_positive)
    e.add_argument("--head-bits", choices=HEAD_BITS_CHOICES, default="auto", help=HEAD_BITS_HELP)

    ch = sub.add_parser("chat", help="chat in the terminal with a model or checkpoint")
    ch.add_argument("--model", required=True)
    ch.add_argument("--head-bits", choices=HEAD_BITS_CHOICES, default="auto", help=HEAD_BITS_HELP)
    ch.add_argument("--max-new-tokens", type=_positive, default=128)
    ch.add_argument("--temperature", type=float, default=0.0)
    ch.add_argument("--prompt", help="answer one prompt and exit (otherwise read prompts from stdin)")

    add_diff_parser(sub, _positive, HEAD_BITS_CHOICES, HEAD_BITS_HELP)

    b = sub.add_parser("bench", help="run a benchmark script from bench/")
    b.add_argument("name", choices=["quality", "kernels", "decode"])
    b.add_argument("args", nargs=argparse.REMAINDER)
    _add_export_parsers(sub)
    _add_tasks_parser(sub)
    return parser


def _add_export_parsers(sub) -> None:
    g = sub.add_parser("export-gguf", help="write a GPTQ / RTN checkpoint (4-bit or 8-bit, groups of 32) as a GGUF "
                       "file llama.cpp loads")
    g.add_argument("--model", required=True, help="a quantized checkpoint directory")
    g.add_argument("--out", required=True, help="the .gguf file to write")
    g.add_argument("--tokenizer-gguf", help="a GGUF file of the same model to copy the tokenizer from (default: "
                   "the GGUF file the run was made from)")


def _add_tasks_parser(sub) -> None:
    t = sub.add_parser("tasks", help="lm-eval tasks on a checkpoint and its original, side by side (needs lm-eval)")
    t.add_argument("--model", required=True, help="a quantized checkpoint directory (or any model)")
    t.add_argument("--tasks", required=True, help="lm-eval task names, comma-separated (e.g. arc_easy,hellaswag)")
    t.add_argument("--limit", type=float, help="at most this many documents per task (below 1: that share)")
    t.add_argument("--num-fewshot", type=int, help="few-shot examples (default: each task's own)")
    t.add_argument("--batch-size", type=_positive, default=8)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--reference", default="auto", help="'auto' = the checkpoint's source model, 'none', or a name/DIR")
    t.add_argument("--include-path", help="a folder of extra task configs (lm-eval YAML)")
    t.add_argument("--head-bits", choices=HEAD_BITS_CHOICES, default="auto", help=HEAD_BITS_HELP)
    t.add_argument("--json", action="store_true", help="print one JSON object")
    t.add_argument("--threads", type=_positive)


def _cmd_tasks(args) -> int:
    from .tasks import TaskSettings, compare_checkpoint, rows_markdown

    if args.limit is not None and args.limit <= 0:
        raise ValueError(f"--limit must be positive, got {args.limit:g}")
    limit = int(args.limit) if args.limit is not None and args.limit >= 1 else args.limit
    settings = TaskSettings(num_fewshot=args.num_fewshot, limit=limit, batch_size=args.batch_size, seed=args.seed)
    rows = compare_checkpoint(args.model, args.tasks, settings, reference=args.reference,
                              include_path=args.include_path, head_bits=args.head_bits)
    if args.json:
        print(json.dumps({"settings": settings.__dict__, "rows": [r.to_dict() for r in rows]}))
    else:
        print(rows_markdown(rows, settings))
    return 0


def _cmd_export_gguf(args) -> int:
    from .gguf_export import export_gguf

    print(json.dumps(export_gguf(args.model, args.out, tokenizer_gguf=args.tokenizer_gguf), indent=2))
    return 0


def _sized_preset(settings: dict, model: str) -> dict:
    """The preset sized for ``model`` (``distill.sized_preset``), saying on stderr what it left out."""
    from .quant.distill import sized_preset
    from .studio.estimate import model_info

    try:
        info = model_info(model)
    except ValueError:
        return settings  # the model's size is not known before loading it: the preset as it is
    settings, note = sized_preset(settings, info.linear_weights + info.other_params)
    if note:
        print(f"note: {note}", file=sys.stderr)
    return settings


def method_config_from_args(args):
    """The validated config object for ``args.method`` (ValueError on bad values or flags that do not apply)."""
    method = methods.get(args.method)
    names = set(method.setting_names)
    settings = {}
    if args.preset:
        candidates = (args.preset, f"{args.preset} bits", f"{args.preset} bit")
        settings = method.preset(next((c for c in candidates if c in method.presets), args.preset))
        if settings.get("distill_iters"):
            settings = _sized_preset(settings, args.model)
    for group in setting_flags().values():
        for name, setting in group.items():
            value = getattr(args, name, None)
            if value is None:
                continue
            if name not in names:
                raise ValueError(f"{setting.flag} does not apply to --method {method.name} (its settings: "
                                 f"{', '.join(sorted(names))})")
            settings[name] = value
    for item in args.extra_settings:
        name, value = parse_assignment(item, "--set")
        settings[name] = value
    if "seed" in names:
        settings.setdefault("seed", args.seed)
    return method.make_config(settings)


def _cmd_quantize(args) -> int:
    import torch

    from .api import partial_status
    from .quant import distributed

    config = method_config_from_args(args)
    calib = CalibConfig(text=args.calib_text, samples=args.calib_samples, seqlen=args.seqlen, seed=args.seed)
    if args.calib_text not in TEXTS and not os.path.isfile(args.calib_text):
        raise ValueError(f"--calib-text must be one of {', '.join(TEXTS)} or an existing file, got {args.calib_text!r}")
    device = None if args.device == "auto" else args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available; use --device cpu or auto")
    unfinished = partial_status(args.out)
    if unfinished and not args.resume:
        raise ValueError(f"--out {args.out} holds an unfinished run ({unfinished['blocks_done']} of "
                         f"{unfinished['blocks_total']} blocks done, in {unfinished['dir']}); pass --resume to "
                         "continue it, or remove that directory to start over")
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:  # under torchrun: one rank per process
        try:
            return _quantize_on_ranks(args, config, calib, device)
        finally:
            distributed.shutdown()
    return _quantize(args, config, calib, device, main=True)


def _quantize_on_ranks(args, config, calib, device) -> int:
    """Join torchrun's process group (gloo on CPU, nccl on CUDA: each rank takes cuda:LOCAL_RANK) and quantize
    with the linears of each block split across the ranks; rank 0 writes the checkpoint and prints."""
    from .quant import distributed

    dev = distributed.init_from_env(device)  # None: CUDA when available
    return _quantize(args, config, calib, str(dev), main=distributed.is_main())


def _quantize(args, config, calib, device, main: bool) -> int:
    from .api import quantize_to_dir

    bar = None
    if not args.quiet and main:
        from .progress_bar import StageBar

        bar = StageBar()

    def on_layer(report) -> None:
        if bar is not None:
            bar.detail(f"{report.module} rel.proxy {report.rel_proxy_loss:.3g}")

    def on_step(phase: str, step: int, steps: int, loss: float) -> None:
        if bar is not None:
            bar.detail(f"{phase} loss {loss:.4g}")

    def on_plan(plan) -> None:
        # the estimate and one line per decision before the run; --quiet keeps only the decisions (what changed)
        lines = plan.lines() if bar is not None else [d.line() for d in plan.decisions]
        for line in lines if main else ():
            if bar is not None:
                bar.write(f"plan: {line}")
            else:
                print(f"plan: {line}", file=sys.stderr, flush=True)

    stream = "auto" if args.stream is None else args.stream
    try:
        out, summary = quantize_to_dir(args.model, args.method, config, calib, args.out, device=device,
                                       on_layer=on_layer, evaluate_after=args.eval, resume=args.resume, stream=stream,
                                       on_step=on_step, head=args.quantize_head, embedding=args.quantize_embedding,
                                       on_progress=bar.on_progress if bar is not None else None, on_plan=on_plan)
    finally:
        if bar is not None:
            bar.close()
    if main:
        print(json.dumps({"out": str(out), **summary}, indent=2, default=str))
    return 0


def _cmd_eval(args) -> int:
    from .api import evaluate_model
    from .eval import kl_stats_text

    result = evaluate_model(args.model, reference=args.reference, text=args.text, seqlen=args.seqlen,
                            max_windows=args.max_windows, dtype=args.dtype, head_bits=args.head_bits,
                            split=args.split)
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        print(f"perplexity {result.perplexity:.3f}  [{result.protocol()}]")
        if result.kl_divergence is not None:
            print(f"reference perplexity {result.reference_perplexity:.3f}, KL {result.kl_divergence:.4f} nats/token, "
                  f"top-1 agreement {result.top1_agreement:.2%}")
            print(kl_stats_text(result.to_dict()))
    return 0


def _cmd_chat(args) -> int:
    from .models import load_model
    from .studio.chat import ChatSession

    model, tok = load_model(args.model, head_bits=args.head_bits)
    session = ChatSession(model, tok)
    prompts = [args.prompt] if args.prompt else (line.strip() for line in sys.stdin)
    for prompt in prompts:
        if not prompt:
            continue
        for piece in session.stream(prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature):
            print(piece, end="", flush=True)
        print(f"\n[{session.last_stats.tokens} tokens, {session.last_stats.tokens_per_second:.1f} tok/s]")
    return 0


def _cmd_bench(args) -> int:
    import runpy

    script = Path(__file__).resolve().parent.parent / "bench" / f"{args.name}.py"
    if not script.is_file():
        raise ValueError(f"benchmark script {script} not found (bench/ ships with the source checkout)")
    sys.argv = [str(script), *args.args]
    runpy.run_path(str(script), run_name="__main__")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "threads", None):
        import torch

        torch.set_num_threads(args.threads)
    handlers = {"quantize": _cmd_quantize, "eval": _cmd_eval, "chat": _cmd_chat, "diff": cmd_diff,
                "bench": _cmd_bench, "export-gguf": _cmd_export_gguf, "tasks": _cmd_tasks}
    try:
        return handlers[args.command](args)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        print(f"{parser.prog} {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        hint = ""
        if args.command == "quantize" and (Path(args.out) / ".partial" / "run.json").is_file():
            hint = f"; the finished blocks are kept in {Path(args.out) / '.partial'}: rerun with --resume to continue"
        print(f"{parser.prog} {args.command}: interrupted{hint}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

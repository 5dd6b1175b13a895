"""Command line: ``python -m vptq_core quantize|eval|chat|bench``.

Bad input exits with code 2 and one line saying what is wrong and what is allowed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .quant.config import CalibConfig, LRQConfig, ScalarConfig, VPTQConfig

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


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m vptq_core", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    q = sub.add_parser("quantize", help="quantize a model and write a packed checkpoint",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    q.add_argument("--model", required=True, help="smollm2-135m-instruct | tiny-random-llama | DIR | hub id")
    q.add_argument("--method", required=True, choices=["vptq", "gptq", "rtn", "lrq"])
    q.add_argument("--out", required=True, help="output directory for the checkpoint")
    q.add_argument("--preset", choices=["2", "3", "4"], help="VPTQ preset bits (sized for small models); "
                   "explicit flags override it")
    v = q.add_argument_group("VPTQ")
    v.add_argument("--vector-len", type=int, help="weights per vector (default 6)")
    v.add_argument("--centroids", type=int, help="codebook size, a power of two (default 4096)")
    v.add_argument("--res-centroids", type=int, help="residual codebook size, 0 = none (default 0)")
    v.add_argument("--outlier-percent", type=float,
                   help="percent of input columns (largest Hessian diagonal) with their own codebook (default 0.5)")
    v.add_argument("--outlier-vector-len", type=int, help="vector length of the outlier codebook (default 4)")
    v.add_argument("--outlier-centroids", type=int, help="outlier codebook size (default 256)")
    v.add_argument("--groups", type=int, help="codebooks per layer for the non-outlier columns (default 1)")
    v.add_argument("--norm", action=argparse.BooleanOptionalAction, default=None,
                   help="per-input-column normalisation (default off)")
    v.add_argument("--perm", action=argparse.BooleanOptionalAction, default=None,
                   help="process columns by decreasing Hessian diagonal (default on)")
    v.add_argument("--kmeans-iters", type=int, help="k-means iterations (default 10)")
    v.add_argument("--finetune-iters", type=int, help="layer-wise centroid fine-tuning steps per block (default 0)")
    v.add_argument("--no-second-order", action="store_true", help="ablation: plain nearest-centroid assignment")
    s = q.add_argument_group("GPTQ / RTN / LRQ")
    s.add_argument("--bits", type=int, help="bits per weight (default 4)")
    s.add_argument("--group-size", type=int, help="weights per scale; 0 = one scale per output channel")
    s.add_argument("--no-act-order", action="store_true", help="GPTQ: natural column order")
    s.add_argument("--rank", type=int, help="LRQ rank, 0 = auto from the layer size")
    s.add_argument("--lr", type=float, help="LRQ learning rate")
    s.add_argument("--iters", type=int, help="LRQ training iterations per block")
    s.add_argument("--full-scale", action="store_true", help="LRQ: learn a full per-weight scale (FlexRound-style)")
    s.add_argument("--act-bits", type=int, help="LRQ / GPTQ / RTN activation bits: 16 = weight-only, 8 = W?A8")
    s.add_argument("--act-granularity", choices=["token", "tensor"],
                   help="activation quantizer: token = dynamic per token, tensor = static per tensor")
    c = q.add_argument_group("calibration")
    c.add_argument("--calib-text", default="wiki", help="'wiki' (bundled) or a UTF-8 text file")
    c.add_argument("--calib-samples", type=_positive, default=32, help="random calibration windows")
    c.add_argument("--seqlen", type=_positive, default=512, help="tokens per calibration window")
    q.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--threads", type=_positive, help="torch CPU threads (default: all cores)")
    q.add_argument("--eval", action="store_true", help="evaluate against the original after quantizing")
    q.add_argument("--quiet", action="store_true", help="no progress bar")

    e = sub.add_parser("eval", help="perplexity (and KL / top-1 agreement vs the original)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    e.add_argument("--model", required=True, help="model name or directory (dense or quantized checkpoint)")
    e.add_argument("--reference", default="auto",
                   help="original model to compare with: 'auto' = the checkpoint's source model, 'none', or a name/DIR")
    e.add_argument("--text", default="wiki", help="'wiki' (bundled, evaluation split) or a UTF-8 text file")
    e.add_argument("--seqlen", type=_positive, default=512)
    e.add_argument("--max-windows", type=_positive, default=None)
    e.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="dense model dtype")
    e.add_argument("--json", action="store_true", help="print one JSON object")
    e.add_argument("--threads", type=_positive)

    ch = sub.add_parser("chat", help="chat in the terminal with a model or checkpoint")
    ch.add_argument("--model", required=True)
    ch.add_argument("--max-new-tokens", type=_positive, default=128)
    ch.add_argument("--temperature", type=float, default=0.0)
    ch.add_argument("--prompt", help="answer one prompt and exit (otherwise read prompts from stdin)")

    b = sub.add_parser("bench", help="run a benchmark script from bench/")
    b.add_argument("name", choices=["quality", "kernels", "decode"])
    b.add_argument("args", nargs=argparse.REMAINDER)
    return parser


def _vptq_settings(args) -> dict:
    from .quant.config import VPTQ_PRESETS

    settings = dict(VPTQ_PRESETS[f"{args.preset} bits"]) if args.preset else {}
    mapping = {
        "vector_len": args.vector_len, "num_centroids": args.centroids, "num_res_centroids": args.res_centroids,
        "outlier_percent": args.outlier_percent, "outlier_vector_len": args.outlier_vector_len,
        "outlier_centroids": args.outlier_centroids, "group_num": args.groups, "enable_norm": args.norm,
        "enable_perm": args.perm, "kmeans_iters": args.kmeans_iters, "finetune_iters": args.finetune_iters,
    }
    settings.update({k: v for k, v in mapping.items() if v is not None})
    if args.no_second_order:
        settings["second_order"] = False
    settings["seed"] = args.seed
    return settings


def method_config_from_args(args):
    """The validated config object for ``args.method`` (ValueError on bad values)."""
    if args.method == "vptq":
        return VPTQConfig(**_vptq_settings(args))
    common = {k: v for k, v in {"bits": args.bits, "group_size": args.group_size}.items() if v is not None}
    common.update({k: v for k, v in {"act_bits": args.act_bits, "act_granularity": args.act_granularity}.items()
                   if v is not None})
    if args.method in ("gptq", "rtn"):
        if args.no_act_order:
            common["act_order"] = False
        return ScalarConfig(**common)
    extra = {"rank": args.rank, "lr": args.lr, "iters": args.iters}
    common.update({k: v for k, v in extra.items() if v is not None})
    if args.full_scale:
        common["full_scale"] = True
    return LRQConfig(seed=args.seed, **common)


def _cmd_quantize(args) -> int:
    import torch

    from .api import quantize_to_dir

    config = method_config_from_args(args)
    calib = CalibConfig(text=args.calib_text, samples=args.calib_samples, seqlen=args.seqlen, seed=args.seed)
    if args.calib_text != "wiki" and not os.path.isfile(args.calib_text):
        raise ValueError(f"--calib-text must be 'wiki' or an existing file, got {args.calib_text!r}")
    device = None if args.device == "auto" else args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available; use --device cpu or auto")
    bar = None
    if not args.quiet:
        from tqdm import tqdm

        bar = tqdm(unit="layer", desc="quantizing")

    def on_layer(report) -> None:
        if bar is not None:
            bar.set_postfix_str(f"block {report.block} {report.module} rel.proxy {report.rel_proxy_loss:.3g}")
            bar.update(1)

    def on_start(total: int) -> None:
        if bar is not None:
            bar.total = total
            bar.refresh()

    out, summary = quantize_to_dir(args.model, args.method, config, calib, args.out, device=device,
                                   on_layer=on_layer, on_start=on_start, evaluate_after=args.eval)
    if bar is not None:
        bar.close()
    print(json.dumps({"out": str(out), **summary}, indent=2, default=str))
    return 0


def _cmd_eval(args) -> int:
    from .api import evaluate_model

    result = evaluate_model(args.model, reference=args.reference, text=args.text, seqlen=args.seqlen,
                            max_windows=args.max_windows, dtype=args.dtype)
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        print(f"perplexity {result.perplexity:.3f}  [{result.protocol()}]")
        if result.kl_divergence is not None:
            print(f"reference perplexity {result.reference_perplexity:.3f}, KL {result.kl_divergence:.4f} nats/token, "
                  f"top-1 agreement {result.top1_agreement:.2%}")
    return 0


def _cmd_chat(args) -> int:
    from .models import load_model
    from .studio.chat import ChatSession

    model, tok = load_model(args.model)
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
    handlers = {"quantize": _cmd_quantize, "eval": _cmd_eval, "chat": _cmd_chat, "bench": _cmd_bench}
    try:
        return handlers[args.command](args)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        print(f"{parser.prog} {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{parser.prog} {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

"""What quantizing the LM head alone costs: SmolLM2-135M-Instruct with only its head quantized, each recipe.

Protocol: the bf16 model; the head's Hessian ``2XᵀX/n`` from its inputs (final-norm outputs) on 32 random
512-token windows (``--samples``, ``--seqlen``) of the bundled wiki calibration split (even articles); each row
quantizes the fp32 head with that method's ``quantize_linear`` (the blocks' recipes: VPTQ v6 k4096 / v4 k4096,
GPTQ 4-bit g128) or with the run-time 8-bit head of ``load_quantized`` (``storage.head.rtn_state``, scales exact
in bf16), puts the dequantized head (bf16) in an untied copy of the model, and evaluates perplexity on held-out
wiki (odd articles) and the Python docs (another domain), ``--windows`` non-overlapping windows of the same
length each; ratio = quantized / bf16 perplexity. The blocks stay bf16, so each row is the head's own cost.

    python bench/head_quality.py [--windows 16] [--threads 2] [--rows vptq-v6,vptq-v4,gptq-4,runtime-8]
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vptq_core.data import calibration_windows  # noqa: E402
from vptq_core.eval import evaluate  # noqa: E402
from vptq_core.models import load_model  # noqa: E402
from vptq_core.quant import methods  # noqa: E402
from vptq_core.quant.embedding import head_hessian  # noqa: E402
from vptq_core.storage.head import rtn_state  # noqa: E402

ROWS = {  # name -> (method or "runtime", settings)
    "vptq-v6": ("vptq", {"vector_len": 6, "num_centroids": 4096, "num_res_centroids": 0}),
    "vptq-v4": ("vptq", {"vector_len": 4, "num_centroids": 4096, "num_res_centroids": 0}),
    "gptq-4": ("gptq", {"bits": 4, "group_size": 128}),
    "runtime-8": ("runtime", {"bits": 8}),
    "runtime-4": ("runtime", {"bits": 4}),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=16, help="evaluation windows per text")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default="smollm2-135m-instruct",
                        help="a built-in model (tiny-random-llama for a quick check of the script)")
    parser.add_argument("--samples", type=int, default=32, help="calibration windows for the head's Hessian")
    parser.add_argument("--seqlen", type=int, default=512, help="tokens per calibration and evaluation window")
    parser.add_argument("--rows", default="vptq-v6,vptq-v4,gptq-4,runtime-8",
                        help=f"comma-separated: {', '.join(ROWS)}")
    args = parser.parse_args()
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        parser.error(f"unknown rows {unknown}; choose from {', '.join(ROWS)}")
    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model, dtype=torch.bfloat16)
    calib = calibration_windows(tok, "wiki", args.samples, args.seqlen)
    with torch.no_grad():
        X = torch.cat([model.model(input_ids=calib[i : i + 4]).last_hidden_state.float()
                       for i in range(0, args.samples, 4)])
    H = head_hessian(X, "cpu")
    W = model.lm_head.weight.detach().float().clone()

    def ppl(m) -> list[float]:
        return [evaluate(m, tok, text=t, max_windows=args.windows, seqlen=args.seqlen).perplexity
                for t in ("wiki", "pydocs")]

    base = ppl(model)
    print(f"Protocol: see the docstring; {args.windows} windows per text, threads {args.threads}")
    print(f"bf16: wiki {base[0]:.3f}, pydocs {base[1]:.3f}\n")
    print("| head | wiki ppl | × bf16 | pydocs ppl | × bf16 | quantize s |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        method, settings = ROWS[row]
        t0 = time.perf_counter()
        if method == "runtime":
            W_hat = rtn_state(W.to(torch.bfloat16), settings["bits"]).dequantize().float()
        else:
            W_hat = methods.get(method).quantize_linear(W, H, methods.make_config(method, settings), None, {}).weight
        seconds = time.perf_counter() - t0
        m = copy.deepcopy(model)
        m.lm_head = torch.nn.Linear(W.shape[1], W.shape[0], bias=False, dtype=torch.bfloat16)
        m.lm_head.weight.data = W_hat.to(torch.bfloat16)
        wiki, pydocs = ppl(m)
        print(f"| {row} {settings} | {wiki:.3f} | {wiki / base[0]:.3f} | {pydocs:.3f} | {pydocs / base[1]:.3f} | "
              f"{seconds:.0f} |", flush=True)


if __name__ == "__main__":
    main()

"""VPTQ ablations on real SmolLM2-135M-Instruct layers: relative proxy loss tr(ΔW H ΔWᵀ)/tr(W H Wᵀ).

For a few layers (Hessians from bundled-wiki calibration windows propagated through the original blocks),
compare: nearest-centroid assignment vs the channel-independent second-order sweep, with and without a
residual codebook, with and without the outlier codebook. Fast (a few minutes on 2 cores):

    python bench/ablation.py [--layers 0:self_attn.q_proj 11:mlp.down_proj ...]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vptq_core.data import calibration_windows  # noqa: E402
from vptq_core.models import load_model  # noqa: E402
from vptq_core.quant.blocks import block_linears, decoder_blocks  # noqa: E402
from vptq_core.quant.config import VPTQConfig  # noqa: E402
from vptq_core.quant.forward import capture_block_inputs, hessians_and_targets, run_batched  # noqa: E402
from vptq_core.quant.vptq import vptq_quantize  # noqa: E402

BASE = dict(vector_len=4, num_centroids=256)
VARIANTS = {
    "nearest centroid, no outliers": dict(second_order=False, outlier_percent=0.0),
    "2nd-order sweep, no outliers": dict(outlier_percent=0.0),
    "2nd-order + outliers 0.5% (default)": {},
    "nearest centroid + outliers": dict(second_order=False),
    "2nd-order + outliers + residual k16 (+1 bit/v)": dict(num_res_centroids=16),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", nargs="*",
                        default=["0:self_attn.q_proj", "5:self_attn.o_proj", "11:mlp.down_proj", "20:mlp.up_proj"])
    parser.add_argument("--calib-samples", type=int, default=16)
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument("--model", default="smollm2-135m-instruct",
                        help="a built-in model (tiny-random-llama for a quick check of the script)")
    args = parser.parse_args()
    wanted: dict[int, list[str]] = {}
    for spec in args.layers:
        block, name = spec.split(":")
        wanted.setdefault(int(block), []).append(name)
    model, tok = load_model(args.model, dtype=torch.float32)
    calib = calibration_windows(tok, "wiki", args.calib_samples, args.seqlen, seed=0)
    rows = []
    with torch.no_grad():
        hidden, kwargs = capture_block_inputs(model, calib)
        for b, block in enumerate(decoder_blocks(model)):
            if b > max(wanted):
                break
            if b in wanted:
                linears = block_linears(block)
                hessians, _ = hessians_and_targets(block, {n: linears[n] for n in wanted[b]}, hidden, kwargs)
                for name in wanted[b]:
                    W = linears[name].weight.data
                    for label, extra in VARIANTS.items():
                        t0 = time.perf_counter()
                        res = vptq_quantize(W, hessians[name], VPTQConfig(**BASE, **extra))
                        rows.append((f"{b}.{name}", label, res.rel_proxy_loss, res.rel_weight_error,
                                     time.perf_counter() - t0))
            hidden = run_batched(block, hidden, kwargs)
    print(f"{args.model} layers, VPTQ v4 k256 (2 index bits), calibration {args.calib_samples} x "
          f"{args.seqlen} tokens of bundled wiki; relative proxy loss tr(dW H dW^T)/tr(W H W^T), lower is better")
    print("| layer | variant | rel. proxy loss | rel. weight error | seconds |")
    print("|---|---|---|---|---|")
    for layer, label, proxy, werr, sec in rows:
        print(f"| {layer} | {label} | {proxy:.4f} | {werr:.3f} | {sec:.1f} |")


if __name__ == "__main__":
    main()

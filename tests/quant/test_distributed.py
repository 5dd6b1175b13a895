"""Several ranks (torch.distributed, gloo on CPU): the linears of each block split across two processes give
the single-process states and checkpoint bit for bit; a stop or a failure on one rank stops both."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import sys
import traceback
from pathlib import Path

import pytest
import torch
from factories import free_port

from vptq_core.quant import distributed
from vptq_core.quant.config import ScalarConfig, VPTQConfig
from vptq_core.quant.methods import QuantResult

CONFIGS = {
    "vptq": VPTQConfig(vector_len=4, num_centroids=16, kmeans_iters=2, outlier_percent=5.0, num_res_centroids=4,
                       enable_norm=True),
    "gptq": ScalarConfig(bits=3, group_size=32),
}


def _tensors(state) -> dict[str, torch.Tensor]:
    values = {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}
    return {k: v for k, v in values.items() if isinstance(v, torch.Tensor)}


def _calib() -> torch.Tensor:
    return torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))


def _run(method: str, out_dir: Path | None, should_stop=None):
    from vptq_core import save_quantized
    from vptq_core.models import tiny_random_llama
    from vptq_core.quant.pipeline import quantize_model

    model, tok = tiny_random_llama()
    qmodel, result = quantize_model(model, _calib(), method, CONFIGS[method], device="cpu", should_stop=should_stop)
    if out_dir is not None and not result.cancelled and distributed.is_main():
        save_quantized(model, tok, result.states, out_dir)
    return result


def _boom(W, H, config, bias, cache):
    if distributed.rank() == 1:
        raise ValueError("rank 1 cannot quantize this")
    from vptq_core.quant.rtn import rtn_layer

    return rtn_layer(W, H, config, bias)


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    report: dict = {}
    try:
        assert distributed.init_from_env("cpu") == torch.device("cpu") and distributed.active()
        for method in CONFIGS:
            result = _run(method, Path(out) / f"ckpt-{method}")
            report[method] = {name: _tensors(state) for name, state in result.states.items()}
            report[f"{method}-timings"] = dict(result.timings)
        # a stop on rank 1 only, asked while it quantizes its share: both ranks stop at the same point
        def stop() -> bool:  # asked from quantize_linears (through the run's shared stop)
            frame = sys._getframe(1)
            while frame is not None and frame.f_code.co_name != "quantize_linears":
                frame = frame.f_back
            return rank == 1 and frame is not None

        cancelled = _run("gptq", None, should_stop=stop)
        report["cancelled"] = (cancelled.cancelled, len(cancelled.states))
        # a failure on rank 1: both ranks raise instead of waiting for each other
        from vptq_core.quant import methods
        from vptq_core.quant.bits import scalar_bits
        from vptq_core.quant.config import ScalarConfig as Config

        methods.register(methods.Method(
            name="boom", label="boom", description="fails on rank 1", config_class=Config,
            bits=lambda c, o, i: scalar_bits(o, i, c.bits, c.group_size), describe=lambda s: "boom",
            quantize_linear=_boom), replace=True)
        CONFIGS["boom"] = Config(bits=4)
        try:
            _run("boom", None)
            report["failure"] = "no error"
        except (ValueError, RuntimeError) as exc:
            report["failure"] = f"{type(exc).__name__}: {exc}"
    except BaseException:  # noqa: BLE001 - the parent asserts on it
        report["error"] = traceback.format_exc()
    finally:
        torch.save(report, Path(out) / f"rank{rank}.pt")
        distributed.shutdown()



def test_assign_balances_weights_and_is_deterministic():
    sizes = {"q": 331_776, "k": 110_592, "v": 110_592, "o": 331_776, "gate": 884_736, "up": 884_736,
             "down": 884_736}
    owner = distributed.assign(sizes, 2)
    assert list(owner) == list(sizes) and owner == distributed.assign(dict(sizes), 2)
    loads = [sum(s for n, s in sizes.items() if owner[n] == r) for r in range(2)]
    assert abs(loads[0] - loads[1]) <= max(sizes.values())
    assert set(distributed.assign(sizes, 1).values()) == {0}
    assert sorted(set(distributed.assign(sizes, 16).values())) == list(range(7))
    with pytest.raises(ValueError, match="world must be >= 1"):
        distributed.assign(sizes, 0)


def test_results_survive_the_byte_packing_bit_for_bit():
    """What ``exchange`` sends: every tensor of a result through one byte buffer, the rest as a skeleton."""
    from vptq_core.quant.vptq import vptq_quantize

    gen = torch.Generator().manual_seed(0)
    W, X = torch.randn(32, 64, generator=gen), torch.randn(512, 64, generator=gen)
    res = vptq_quantize(W, 2 * X.T @ X / 512, VPTQConfig(vector_len=4, num_centroids=16, kmeans_iters=2,
                                                          outlier_percent=5.0, num_res_centroids=4))
    mine = {"a": (res, 1.5), "b": {"codes": torch.arange(6, dtype=torch.uint8).view(2, 3), "flag": torch.tensor(True)}}
    tensors: list[torch.Tensor] = []
    skeletons = distributed._strip(mine, tensors)
    buffer = distributed._to_bytes(tensors, torch.device("cpu"))
    assert buffer.dtype == torch.uint8 and buffer.numel() == sum(t.numel() * t.element_size() for t in tensors)
    values = distributed._from_bytes(buffer, distributed._slots(skeletons, []), torch.device("cpu"))
    back = distributed._fill(skeletons, values)
    res2, seconds = back["a"]
    assert isinstance(res2, QuantResult) and seconds == 1.5 and res2.rel_proxy_loss == res.rel_proxy_loss
    assert torch.equal(res2.weight, res.weight)
    for key, tensor in _tensors(res.state).items():
        assert torch.equal(_tensors(res2.state)[key], tensor) and _tensors(res2.state)[key].dtype == tensor.dtype
    assert torch.equal(back["b"]["codes"], mine["b"]["codes"]) and bool(back["b"]["flag"])
    assert res2.state.dequantize().equal(res.state.dequantize())


def test_without_a_process_group_everything_is_a_no_op():
    assert not distributed.active() and distributed.rank() == 0 and distributed.world_size() == 1
    assert distributed.is_main() and distributed.agree(distributed.STOPPED) == distributed.STOPPED
    assert distributed.exchange({"x": 1}, "cpu") == {"x": 1}
    assert distributed.init_from_env("cpu") == torch.device("cpu")  # no WORLD_SIZE: nothing joined
    with pytest.raises(RuntimeError, match="not initialised"):
        distributed.enable()


@pytest.mark.slow
def test_two_gloo_ranks_give_the_single_process_states_and_checkpoint(tmp_path: Path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # thread counts change float rounding: one thread, like each rank
    try:
        single = {m: _run(m, tmp_path / f"single-{m}") for m in CONFIGS}
    finally:
        torch.set_num_threads(threads)

    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, str(tmp_path)), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, "a rank hung"
    reports = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for report in reports:
        assert "error" not in report, report.get("error")
    for method, result in single.items():
        for report in reports:
            assert list(report[method]) == list(result.states)
            for name, state in result.states.items():
                for key, tensor in _tensors(state).items():
                    assert torch.equal(report[method][name][key], tensor), (method, name, key)
        assert "exchange" in reports[0][f"{method}-timings"]
        for file in ("model.safetensors", "config.json"):
            dist_file, single_file = tmp_path / f"ckpt-{method}" / file, tmp_path / f"single-{method}" / file
            assert dist_file.read_bytes() == single_file.read_bytes(), file
    for report in reports:
        assert report["cancelled"] == (True, 0)
    assert reports[1]["failure"] == "ValueError: rank 1 cannot quantize this"
    assert reports[0]["failure"].startswith("RuntimeError: another rank failed while quantizing block 0")


@pytest.mark.slow
def test_torchrun_cli_writes_the_single_process_checkpoint(tmp_path: Path):
    """``torchrun --nproc-per-node 2 -m vptq_core quantize`` (gloo, a streamed safetensors directory): rank 0
    alone writes, and its checkpoint equals the one-process CLI run's bit for bit."""
    import subprocess

    from vptq_core.models import tiny_random_model

    model_dir = tmp_path / "llama"
    model, tok = tiny_random_model("llama", num_layers=2)
    model.save_pretrained(str(model_dir))
    tok.save_pretrained(str(model_dir))
    text = tmp_path / "calib.txt"
    text.write_text("Plain words for a small calibration text, repeated. " * 40, encoding="utf-8")
    args = ["-m", "vptq_core", "quantize", "--model", str(model_dir), "--method", "gptq", "--bits", "3",
            "--group-size", "32", "--calib-text", str(text), "--calib-samples", "4", "--seqlen", "32",
            "--threads", "1", "--device", "cpu", "--quiet"]
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": root}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    single = subprocess.run([sys.executable, *args, "--out", str(tmp_path / "single")], env=env,
                            capture_output=True, text=True, timeout=300)
    assert single.returncode == 0, single.stderr[-2000:]
    ranks = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                            "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *args,
                            "--out", str(tmp_path / "ranks")], env=env, capture_output=True, text=True, timeout=300)
    assert ranks.returncode == 0, ranks.stderr[:3000]
    summary = json.loads(ranks.stdout)  # one summary, printed by rank 0 alone
    assert summary["ranks"] == 2 and summary["timings"]["exchange"] >= 0
    for file in ("model.safetensors", "config.json"):
        assert (tmp_path / "ranks" / file).read_bytes() == (tmp_path / "single" / file).read_bytes(), file
    assert not (tmp_path / "ranks" / ".partial").exists()
    report = json.loads((tmp_path / "ranks" / "quant_report.json").read_text())
    assert report["streaming"] == "on"

"""Job runner: queue order and positions, cancel between layers, failures with their reason, per-owner
isolation, pruning; the pre-run estimate; the model cache."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from pathlib import Path

import pytest

from vptq_core.models import TINY, tiny_random_llama
from vptq_core.quant.config import CalibConfig, ScalarConfig, VPTQConfig
from vptq_core.quant.pipeline import LayerReport
from vptq_core.resume import PartialRun
from vptq_core.storage.archive import inspect_archive
from vptq_core.studio import views
from vptq_core.studio.estimate import estimate, model_info
from vptq_core.studio.model_cache import ModelCache
from vptq_core.studio.queue import JobCancelled, JobManager, owner_digest
from vptq_core.studio.task import quantization_task

TINY_CALIB = CalibConfig(samples=4, seqlen=64, seed=0)
TINY_VPTQ = VPTQConfig(vector_len=4, num_centroids=16, outlier_percent=0.0, kmeans_iters=2, kmeans_sample=1024)


def _gated(log: list, name: str, gate: threading.Event):
    def task(ctx):
        log.append(("start", name))
        assert gate.wait(20), "test gate never opened"
        log.append(("end", name))
        return {"name": name}

    return task


def test_queue_runs_in_order_with_positions(tmp_path: Path):
    manager = JobManager(tmp_path, limits={"cpu": 1})
    log: list = []
    gates = {n: threading.Event() for n in "abc"}
    a = manager.submit("alice", _gated(log, "a", gates["a"]), title="a")
    b = manager.submit("bob", _gated(log, "b", gates["b"]), title="b")
    c = manager.submit("carol", _gated(log, "c", gates["c"]), title="c")
    assert a.status == "running" and a.position == 0
    assert (b.status, b.position, b.running_ahead) == ("queued", 1, 1)
    assert (c.status, c.position) == ("queued", 2)
    gates["a"].set()
    assert manager.wait(a.id, "alice", timeout=10).status == "done"
    deadline = time.monotonic() + 10
    while manager.get(b.id, "bob").status != "running" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert manager.get(b.id, "bob").status == "running"
    assert manager.get(c.id, "carol").position == 1
    gates["b"].set()
    gates["c"].set()
    assert manager.wait(c.id, "carol", timeout=10).result == {"name": "c"}
    assert log == [("start", "a"), ("end", "a"), ("start", "b"), ("end", "b"), ("start", "c"), ("end", "c")]


def test_devices_have_separate_limits(tmp_path: Path):
    manager = JobManager(tmp_path, limits={"cpu": 1, "cuda": 2})
    gate = threading.Event()
    log: list = []
    jobs = [manager.submit(f"u{i}", _gated(log, str(i), gate), device="cuda") for i in range(3)]
    cpu = manager.submit("u9", _gated(log, "cpu", gate), device="cpu")
    assert [j.status for j in jobs] == ["running", "running", "queued"] and cpu.status == "running"
    gate.set()
    for j in jobs:
        assert manager.wait(j.id, j.owner, timeout=10).status == "done"
    with pytest.raises(ValueError, match=r"device must be one of \['cpu', 'cuda'\], got 'tpu'"):
        manager.submit("u0", _gated(log, "x", gate), device="tpu")


def test_cancel_a_queued_job_moves_the_queue_up(tmp_path: Path):
    manager = JobManager(tmp_path, limits={"cpu": 1})
    gate, log = threading.Event(), []
    a = manager.submit("alice", _gated(log, "a", gate))
    b = manager.submit("bob", _gated(log, "b", gate))
    c = manager.submit("carol", _gated(log, "c", gate))
    assert manager.cancel(b.id, "bob").status == "cancelled"
    assert manager.get(c.id, "carol").position == 1
    gate.set()
    assert manager.wait(c.id, "carol", timeout=10).status == "done"
    assert ("start", "b") not in log and manager.get(a.id, "alice").status == "done"


@pytest.mark.slow
def test_cancel_stops_a_real_quantization_between_layers(tmp_path: Path):
    """Cancel requested after the 2nd layer: the pipeline stops before the 3rd, nothing is kept on disk, and
    the next job runs normally."""
    manager = JobManager(tmp_path, limits={"cpu": 1})
    inner = quantization_task(TINY, "vptq", TINY_VPTQ, TINY_CALIB)
    holder: dict = {}

    def task(ctx):
        publish = ctx.on_layer

        def on_layer(report):
            publish(report)
            if manager.get(ctx.job_id, "alice", reports=False).layers_done == 2:
                manager.cancel(holder["id"], "alice")

        ctx.on_layer = on_layer
        return inner(ctx)

    job = manager.submit("alice", task)
    holder["id"] = job.id
    done = manager.wait(job.id, "alice", timeout=120)
    assert done.status == "cancelled" and done.error is None
    assert done.layers_done == 2 and done.total_layers == 14
    assert [r["module"] for r in done.reports] == ["self_attn.q_proj", "self_attn.k_proj"]
    assert not (tmp_path / "jobs" / job.id).exists()
    after = manager.submit("alice", quantization_task(TINY, "rtn", ScalarConfig(bits=4, group_size=32), TINY_CALIB))
    assert manager.wait(after.id, "alice", timeout=120).status == "done"


@pytest.mark.slow
def test_finished_quantization_job_has_reports_checkpoint_and_archive(tmp_path: Path):
    manager = JobManager(tmp_path)
    config = ScalarConfig(bits=3, group_size=32)
    job = manager.submit("alice", quantization_task(TINY, "gptq", config, TINY_CALIB), title="gptq")
    snap = manager.wait(job.id, "alice", timeout=120)
    assert snap.status == "done", snap.error
    assert snap.total_layers == snap.layers_done == 14
    assert snap.reports_version == (14, 14) and snap.phase == "done"
    result = snap.result
    ckpt = Path(result["checkpoint_dir"])
    # The job published exactly the reports the checkpoint keeps, each block's output error on all its layers.
    report = json.loads((ckpt / "quant_report.json").read_text())
    assert list(snap.reports) == report["layers"]
    for block in (0, 1):
        errors = {r["rel_output_error"] for r in snap.reports if r["block"] == block}
        assert len(errors) == 1 and None not in errors
    # A 3-bit grid on groups of 32 leaves RTN a relative proxy error of 0.025-0.037 per layer on this model
    # (the grid step / sqrt(12) is ~0.17 of the weights' spread); GPTQ's error feedback must beat it on every
    # layer (it measures 0.001-0.006).
    assert max(r["rel_proxy_loss"] for r in snap.reports) < 0.02
    names = sorted(e.name for e in inspect_archive(result["archive"]))
    assert names == sorted(p.name for p in ckpt.iterdir())
    assert result["archive_bytes"] == Path(result["archive"]).stat().st_size
    # The estimate shown before the run matches the bits the run reports.
    est = estimate(model_info(TINY), "gptq", config)
    assert est.total_bits_per_weight == pytest.approx(result["summary"]["total_bits_per_weight"], rel=1e-12)
    assert est.index_bits_per_weight == pytest.approx(3.0)


def test_failures_keep_their_reason(tmp_path: Path):
    manager = JobManager(tmp_path)

    def value_error(ctx):
        raise ValueError("samples must be >= 1, got 0")

    def crash(ctx):
        return {}["missing"]

    a = manager.wait(manager.submit("alice", value_error).id, "alice", timeout=10)
    assert (a.status, a.error) == ("failed", "samples must be >= 1, got 0")
    b = manager.wait(manager.submit("alice", crash).id, "alice", timeout=10)
    assert (b.status, b.error) == ("failed", "KeyError: 'missing'")
    # A real failure inside the pipeline: calibration text shorter than one window.
    short = tmp_path / "short.txt"
    short.write_text("too short")
    task = quantization_task(TINY, "rtn", ScalarConfig(), CalibConfig(samples=4, seqlen=64), calib_text="too short")
    c = manager.wait(manager.submit("alice", task).id, "alice", timeout=60)
    assert c.status == "failed"
    assert c.error.startswith("calibration text has 9 tokens, fewer than seqlen+1 (65)")
    assert not (tmp_path / "jobs" / c.id).exists()

    def cancelled(ctx):
        raise JobCancelled

    d = manager.wait(manager.submit("alice", cancelled).id, "alice", timeout=10)
    assert (d.status, d.error) == ("cancelled", None)


def test_owners_see_only_their_jobs(tmp_path: Path):
    manager = JobManager(tmp_path)
    job = manager.submit("alice", lambda ctx: {"x": 1})
    manager.wait(job.id, "alice", timeout=10)
    for call in (lambda: manager.get(job.id, "bob"), lambda: manager.cancel(job.id, "bob"),
                 lambda: manager.set_extra(job.id, "bob", "eval", {}), lambda: manager.checkpoint_dir(job.id, "bob")):
        with pytest.raises(ValueError, match=rf"no job '{job.id}' in this session"):
            call()
    assert manager.jobs("bob") == [] and [s.id for s in manager.jobs("alice")] == [job.id]
    with pytest.raises(ValueError, match=r"owner must be a non-empty session id"):
        manager.jobs("")


def test_limits_per_owner_and_queue(tmp_path: Path):
    manager = JobManager(tmp_path, limits={"cpu": 1}, max_active_per_owner=2, max_queued=2)
    gate, log = threading.Event(), []
    manager.submit("alice", _gated(log, "a1", gate))
    manager.submit("alice", _gated(log, "a2", gate))
    with pytest.raises(ValueError, match=r"you already have 2 job\(s\) queued or running \(limit 2\)"):
        manager.submit("alice", _gated(log, "a3", gate))
    manager.submit("bob", _gated(log, "b1", gate))
    with pytest.raises(ValueError, match=r"the queue is full \(2 jobs waiting\)"):
        manager.submit("carol", _gated(log, "c1", gate))
    gate.set()
    manager.shutdown(timeout=10)


def test_runs_per_owner_are_capped_old_runs_expire_and_owner_cleanup(tmp_path: Path):
    manager = JobManager(tmp_path, max_runs_per_owner=2, max_age_s=3600)
    deleted: list[tuple[str, str]] = []
    manager.on_delete(lambda job_id, owner: deleted.append((job_id, owner)))

    def write(ctx):
        (ctx.out_dir / "weights.bin").write_bytes(b"x" * 10)
        return {}

    ids = []
    for _ in range(2):
        ids.append(manager.submit("alice", write).id)
        manager.wait(ids[-1], "alice", timeout=10)
    # A third run is refused (nothing is deleted behind the owner's back); another owner is not affected.
    with pytest.raises(ValueError, match=r"you already have 2 runs kept or in progress \(limit 2 per browser\)"):
        manager.submit("alice", write)
    with pytest.raises(ValueError, match=r"limit 2 per browser"):
        manager.import_run("alice", lambda out_dir: {})
    bob = manager.submit("bob", write).id
    manager.wait(bob, "bob", timeout=10)
    assert [s.id for s in manager.jobs("alice")] == ids and manager.disk_usage("alice") == 20
    assert manager.disk_usage() == 30
    # Deleting one makes room; failed and cancelled jobs hold no files and do not count.
    manager.delete(ids[0], "alice")
    assert not (tmp_path / "jobs" / ids[0]).exists() and deleted == [(ids[0], "alice")]
    failed = manager.submit("alice", lambda ctx: 1 / 0).id
    assert manager.wait(failed, "alice", timeout=10).status == "failed"
    ids.append(manager.submit("alice", write).id)
    manager.wait(ids[-1], "alice", timeout=10)
    # Runs expire max_age_s after they finish (the clock moved on by an hour and a second).
    with manager._lock:
        for job in manager._jobs.values():
            if job.id in (ids[1], bob):
                job.finished -= 3601
    assert sorted(manager.prune()) == sorted([ids[1], bob])
    assert not (tmp_path / "jobs" / ids[1]).exists() and (tmp_path / "jobs" / ids[2] / "weights.bin").is_file()
    assert {s.id for s in manager.jobs("alice")} == {ids[2], failed} and manager.jobs("bob") == []
    with pytest.raises(ValueError, match=rf"no job '{ids[1]}' in this session .*deleted 1 h after they finish"):
        manager.get(ids[1], "alice")
    # The owner is gone (an API session closed): every job is cancelled and its files deleted.
    gate = threading.Event()
    running = manager.submit("alice", _gated([], "r", gate))
    assert manager.forget_owner("alice") == 3
    assert manager.jobs("alice") == []
    assert not any((tmp_path / "jobs" / i).exists() for i in ids)
    gate.set()
    deadline = time.monotonic() + 10
    while (tmp_path / "jobs" / running.id).exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not (tmp_path / "jobs" / running.id).exists()


def test_reassign_moves_jobs_to_the_lasting_identity(tmp_path: Path):
    manager = JobManager(tmp_path)
    job = manager.submit("session-1", lambda ctx: {}).id
    manager.wait(job, "session-1", timeout=10)
    assert manager.reassign("session-1", "identity-A") == 1
    assert manager.get(job, "identity-A").status == "done"
    with pytest.raises(ValueError, match="no job"):
        manager.get(job, "session-1")


def test_stale_job_dirs_are_removed_on_start(tmp_path: Path):
    (tmp_path / "jobs" / "0123456789ab").mkdir(parents=True)
    (tmp_path / "jobs" / "keep-me").mkdir()
    JobManager(tmp_path)
    assert not (tmp_path / "jobs" / "0123456789ab").exists() and (tmp_path / "jobs" / "keep-me").is_dir()


def test_import_run_registers_or_cleans_up(tmp_path: Path):
    manager = JobManager(tmp_path)

    def fill(out_dir: Path) -> dict:
        (out_dir / "checkpoint").mkdir()
        return {"checkpoint_dir": str(out_dir / "checkpoint")}

    snap = manager.import_run("alice", fill, title="uploaded")
    assert (snap.status, snap.kind) == ("done", "import")
    assert manager.checkpoint_dir(snap.id, "alice") == tmp_path / "jobs" / snap.id / "checkpoint"

    def broken(out_dir: Path) -> dict:
        (out_dir / "partial").write_text("x")
        raise ValueError("archive has no config.json; it is not a checkpoint")

    with pytest.raises(ValueError, match="no config.json"):
        manager.import_run("alice", broken)
    assert [p.name for p in (tmp_path / "jobs").iterdir()] == [snap.id]


def test_model_info_and_its_errors(tmp_path: Path, monkeypatch):
    info = model_info(TINY)
    assert info.num_blocks == 2
    assert info.modules == ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    assert info.linear_shapes[:7] == ((64, 64), (32, 64), (32, 64), (64, 64), (128, 64), (128, 64), (64, 128))
    model, tok = tiny_random_llama()
    total = sum(p.numel() for p in model.parameters())
    assert info.other_params + info.linear_weights == total
    # A dense local directory is read from its config alone and agrees.
    model.save_pretrained(tmp_path / "dense")
    local = model_info(str(tmp_path / "dense"))
    assert (local.linear_shapes, local.other_params) == (info.linear_shapes, info.other_params)
    (tmp_path / "quant").mkdir()
    (tmp_path / "quant" / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "vptq"}}))
    with pytest.raises(ValueError, match=r"already a quantized checkpoint"):
        model_info(str(tmp_path / "quant"))
    with pytest.raises(ValueError, match=r"has no config.json"):
        model_info(str(tmp_path))
    with pytest.raises(ValueError, match=r"'not a model' is not a built-in name"):
        model_info("not a model")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match=r"cannot reach the Hugging Face hub to fetch 'someone/some-model'"):
        model_info("someone/some-model")


def test_estimate_counts_codebooks_and_kept_weights():
    info = model_info(TINY)
    config = VPTQConfig(vector_len=4, num_centroids=16, outlier_percent=0.0, enable_perm=False)
    est = estimate(info, "vptq", config)
    weights = info.linear_weights
    # 4 index bits per 4-vector, plus one 16-entry fp16 codebook of 4-vectors per linear.
    codebook_bits = len(info.linear_shapes) * 16 * 4 * 16
    assert est.index_bits_per_weight == 1.0
    assert est.total_bits_per_weight == pytest.approx((weights + codebook_bits) / weights)
    assert est.quantized_bytes == (weights + codebook_bits) // 8
    assert est.checkpoint_bytes == est.quantized_bytes + 2 * info.other_params
    assert est.dense_bytes == 2 * (weights + info.other_params)


def test_time_estimate_sums_each_layer_with_its_own_settings():
    from vptq_core.quant.vptq import layer_config
    from vptq_core.studio.estimate import vptq_layer_phases

    capped = VPTQConfig(vector_len=6, num_centroids=4096, layer_bits_cap=2.5)
    # SmolLM2's k/v projection (192x576) does not fit 2.5 bits at v6 k4096: it is estimated as the v4 k256 the
    # run will use, and costs less than the uncapped layer
    small = layer_config(capped, 192, 576)
    assert (small.vector_len, small.num_centroids) == (4, 256)
    assert vptq_layer_phases(192, 576, capped) == vptq_layer_phases(192, 576, small)
    assert vptq_layer_phases(192, 576, capped)["whole"] < vptq_layer_phases(
        192, 576, dataclasses.replace(capped, layer_bits_cap=0.0))["whole"]
    # a residual codebook adds its k-means and a second sweep; more k-means iterations cost more
    plain = VPTQConfig(vector_len=4, num_centroids=256, outlier_percent=0.0)
    res = dataclasses.replace(plain, num_res_centroids=256)
    p, r = vptq_layer_phases(1536, 576, plain), vptq_layer_phases(1536, 576, res)
    assert r["kmeans"] == pytest.approx(2 * p["kmeans"]) and r["sweep"] > 2 * p["sweep"]
    assert vptq_layer_phases(1536, 576, dataclasses.replace(plain, kmeans_iters=10))["kmeans"] > p["kmeans"]
    # a layer with fewer vectors than centroids needs no k-means (every vector is a centroid)
    assert vptq_layer_phases(16, 64, VPTQConfig(vector_len=8, num_centroids=256, outlier_percent=0.0))[
        "kmeans"] == 0.0


def test_time_estimate_of_the_presets_matches_their_runs(monkeypatch):
    """The runs the constants were checked against (CLI, SmolLM2-135M, 32 x 512 calibration tokens, 2 threads,
    alone on the AMD machine; README "Quantization time"): the pipeline's seconds in quant_report.json. Those runs
    searched codebooks with the k-d tree, which the estimate prices when the search is forced to it."""
    monkeypatch.setenv("VPTQ_NEAREST", "kdtree")
    from vptq_core.quant.vptq import PRESETS
    from vptq_core.studio.estimate import time_estimate, vptq_layer_phases

    info = model_info("smollm2-135m-instruct")
    # those runs checkpointed the blocks during distillation and had no time budget; "2.5 bits" capped every layer
    # at 2.5 bits then (its total-bits budget came later)
    measured = {"distill_checkpointing": True, "time_budget": 0.0}
    two = VPTQConfig(**{**PRESETS["2.5 bits"], "distill_iters": 32, "bits_budget": 0.0, "layer_bits_cap": 2.5,
                        "allocation": "cap",
                        **measured})
    # ... and "3.5 bits" capped every layer at 3.5 bits (its budget, planned by sensitivity, came later still)
    three = VPTQConfig(**{**PRESETS["3.5 bits"], "calib_sampled_share": 0.5, "bits_budget": 0.0, "layer_bits_cap": 3.5,
                          "allocation": "cap", **measured})
    # per layer: the sum of the 210 layers' seconds (k-means, sweep, the rest) in the run
    assert sum(vptq_layer_phases(o, i, two)["whole"] for o, i in info.linear_shapes) == pytest.approx(116, rel=0.15)
    assert sum(vptq_layer_phases(o, i, three)["whole"] for o, i in info.linear_shapes) == pytest.approx(78, rel=0.15)
    # whole runs: 416 s ("2.5 bits"), 440 s ("3.5 bits" with half self-written calibration)
    assert time_estimate(info, two, 32, 512) == pytest.approx(416, rel=0.1)
    assert time_estimate(info, three, 32, 512) == pytest.approx(440, rel=0.1)
    # a time budget caps distillation at what the block stage leaves of it, never the block stage itself
    no_kd = time_estimate(info, dataclasses.replace(two, distill_iters=0), 32, 512)
    assert time_estimate(info, dataclasses.replace(two, time_budget=no_kd + 50), 32, 512) == pytest.approx(no_kd + 50)
    # ... and a budget the self-written windows would take more than their share of leaves them out, as the run does
    no_kd_text = time_estimate(info, dataclasses.replace(two, distill_iters=0, calib_sampled_share=0.0), 32, 512)
    assert no_kd_text < no_kd
    assert time_estimate(info, dataclasses.replace(two, time_budget=60), 32, 512) == pytest.approx(no_kd_text)
    # unchecked blocks (the "auto" setting where the activations fit) make the steps cheaper
    assert time_estimate(info, dataclasses.replace(two, distill_checkpointing=False), 32, 512) < time_estimate(
        info, two, 32, 512)


def test_time_estimate_of_lrq_matches_its_runs():
    """LRQ W4A8 with FP-chain targets (bench/results/quality_v10c.jsonl, lrq-w4a8-fp and lrq-w4a8-fp64): 476 s
    with 32 training steps per block, 573 s with 64; and with 64 steps of distillation on mixed data 824 s
    (quality_lrq_kd.jsonl, lrq-w4a8-asym-fp-kd64-mixed; 884 s in a fresh run, quality_lrq_fresh.jsonl)."""
    from vptq_core.quant.config import LRQConfig
    from vptq_core.studio.estimate import time_estimate

    info = model_info("smollm2-135m-instruct")
    fp = LRQConfig(bits=4, act_bits=8, act_granularity="token", target_chain="fp")
    assert time_estimate(info, fp, 32, 512) == pytest.approx(476, rel=0.1)
    assert time_estimate(info, dataclasses.replace(fp, iters=64), 32, 512) == pytest.approx(573, rel=0.1)
    kd = LRQConfig(bits=4, act_bits=8, act_granularity="token_asym", target_chain="fp", distill_iters=64,
                   distill_data="mixed", distill_lr=5e-3)
    assert time_estimate(info, kd, 32, 512) == pytest.approx(824, rel=0.1)


def test_model_cache_loads_once_evicts_and_does_not_cache_errors():
    cache = ModelCache(max_items=2)
    calls: list = []
    started = threading.Barrier(4)

    def slow_loader():
        calls.append(1)
        time.sleep(0.2)
        return object()

    results = []

    def worker():
        started.wait()
        results.append(cache.get("a", slow_loader))

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len({id(r) for r in results}) == 1
    cache.get("b", lambda: 2)
    cache.get("a", slow_loader)  # touch: "b" is now the oldest
    cache.get("c", lambda: 3)
    assert "a" in cache and "c" in cache and "b" not in cache
    with pytest.raises(RuntimeError, match="disk on fire"):
        cache.get("d", lambda: (_ for _ in ()).throw(RuntimeError("disk on fire")))
    assert "d" not in cache and cache.get("d", lambda: 4) == 4
    assert "a" not in cache  # evicted by "d"
    assert cache.drop(lambda k: k in ("c", "d")) == 2 and "c" not in cache and "d" not in cache


# ------------------------------------------------------------------------------------------ restarts
class _Killed(BaseException):
    """Stands in for the process dying mid-run: the job thread ends without any cleanup."""


def _finished_run(ctx):
    ckpt = ctx.out_dir / "checkpoint"
    ckpt.mkdir(exist_ok=True)  # (a resumed run finds its unfinished one there)
    (ckpt / "model.safetensors").write_bytes(b"weights")
    (ctx.out_dir / "run.zip").write_bytes(b"zip")
    ctx.on_start(1)
    ctx.on_layer(LayerReport(block=0, name="model.layers.0.mlp.down_proj", module="mlp.down_proj", out_features=4,
                             in_features=4, method="rtn", rel_proxy_loss=0.25, rel_weight_error=0.5, index_bits=2.0,
                             total_bits=2.5, seconds=0.1, rel_output_error=0.125))
    return {"checkpoint_dir": str(ckpt), "archive": str(ctx.out_dir / "run.zip"), "summary": {"layers": 1}}


def _cut_off(ctx):
    PartialRun(ctx.out_dir / "checkpoint").start({"model": "m"}, 3)  # what quantize_to_dir writes first
    raise _Killed


def _leftover(jobs_dir: Path, job_id: str, **fields) -> Path:
    directory = jobs_dir / job_id
    (directory / "checkpoint").mkdir(parents=True)
    data = {"format": 1, "id": job_id, "owner_sha256": owner_digest("alice"), "title": "t", "kind": "quantize",
            "device": "cpu", "created": time.time(), "started": time.time(), "finished": time.time(),
            "state": "done", "meta": {}, "extras": {}, "result": {"checkpoint_dir": "checkpoint"}, "reports": []}
    data.update(fields)
    (directory / "job.json").write_text(json.dumps(data), encoding="utf-8")
    return directory


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_runs_come_back_after_a_restart_for_their_owner_only(tmp_path: Path):
    before = JobManager(tmp_path)
    done = before.wait(before.submit("alice", _finished_run, title="done", meta={"model": TINY}).id, "alice", 10)
    before.set_extra(done.id, "alice", "eval", {"perplexity": 12.5})
    cut = before.submit("alice", _cut_off, title="cut", meta={"model": TINY, "method": "rtn"}).id
    before._threads[cut].join(10)
    assert before.get(cut, "alice").status == "running"  # nobody noticed: the process is gone
    jobs = tmp_path / "jobs"
    for job_id in (done.id, cut):
        text = (jobs / job_id / "job.json").read_text(encoding="utf-8")
        assert "alice" not in text and json.loads(text)["owner_sha256"] == owner_digest("alice")
    # What else an earlier process may leave: each is removed at start-up.
    (jobs / "0123456789ab").mkdir()  # no description
    (jobs / "0123456789ac").mkdir()
    (jobs / "0123456789ac" / "job.json").write_text("{not json", encoding="utf-8")
    bad = [_leftover(jobs, "0123456789ad", finished=time.time() - 13 * 3600),  # expired
           _leftover(jobs, "0123456789ae", result={"checkpoint_dir": "../0123456789ab"}),  # outside its directory
           _leftover(jobs, "0123456789af", id="0123456789aa"),  # not its own directory
           _leftover(jobs, "0123456789b0", state="started"),  # started, never finished a block
           _leftover(jobs, "0123456789b1", owner_sha256="alice"),  # a raw id instead of a hash
           _leftover(jobs, "0123456789b2", reports=[{"block": "x"}])]
    kept = _leftover(jobs, "0123456789b3")

    after = JobManager(tmp_path, max_active_per_owner=1, max_runs_per_owner=4)
    assert sorted(p.name for p in jobs.iterdir()) == sorted([done.id, cut, kept.name])
    assert not any(p.exists() for p in bad)
    assert after.jobs("bob") == [] and after.disk_usage("bob") == 0
    for call in (lambda: after.get(cut, "bob"), lambda: after.resume(cut, "bob", _finished_run)):
        with pytest.raises(ValueError, match=f"no job '{cut}' in this session"):
            call()
    assert after.disk_usage() >= len(b"weights")
    snaps = {s.id: s for s in after.jobs("alice", reports=True)}
    assert sorted(snaps) == sorted([done.id, cut, kept.name])
    back = snaps[done.id]
    assert (back.status, back.title, back.meta, back.extras) == ("done", "done", {"model": TINY},
                                                                  {"eval": {"perplexity": 12.5}})
    assert back.result == done.result and back.reports == done.reports and back.layers_done == 1
    assert after.checkpoint_dir(done.id, "alice") == jobs / done.id / "checkpoint"
    interrupted = snaps[cut]
    assert interrupted.status == "interrupted" and not interrupted.active
    assert interrupted.extras == {"interrupted": {"blocks_done": 0, "blocks_total": 3}}
    assert "0 of 3 blocks" in interrupted.phase
    shown = views.progress_html(interrupted)
    assert 'data-status="interrupted"' in shown and "0 of 3 blocks done" in shown and "press Resume" in shown

    # Limits still apply: a running job blocks the resume (1 active per owner), and the interrupted run counts
    # among the runs kept (4: done, interrupted, the leftover, the running one), so nothing new may start.
    gate = threading.Event()
    running = after.submit("alice", lambda ctx: {"ok": gate.wait(10)}).id
    with pytest.raises(ValueError, match=r"you already have 1 job\(s\) queued or running \(limit 1\)"):
        after.resume(cut, "alice", _finished_run)
    gate.set()
    after.wait(running, "alice", timeout=10)
    with pytest.raises(ValueError, match="4 runs kept or in progress"):
        after.submit("alice", lambda ctx: {})
    with pytest.raises(ValueError, match="was not interrupted"):
        after.resume(done.id, "alice", _finished_run)
    resumed = after.resume(cut, "alice", _finished_run)
    assert resumed.status in ("queued", "running") and resumed.extras == {}
    finished = after.wait(cut, "alice", timeout=10)
    assert finished.status == "done" and finished.result["checkpoint_dir"] == str(jobs / cut / "checkpoint")
    assert json.loads((jobs / cut / "job.json").read_text(encoding="utf-8"))["state"] == "done"
    # A page that attaches after starting: its jobs' descriptions follow the identity.
    job = after.wait(after.submit("session-1", _finished_run).id, "session-1", timeout=10)
    after.reassign("session-1", "identity-A")
    text = (jobs / job.id / "job.json").read_text(encoding="utf-8")
    assert json.loads(text)["owner_sha256"] == owner_digest("identity-A") and "session-1" not in text
    assert JobManager(tmp_path).get(job.id, "identity-A").status == "done"

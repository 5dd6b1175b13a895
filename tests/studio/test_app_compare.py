"""Any two runs side by side in the chat (the same prompt and seed on both sides, a Stop per side, memory checked
before two models load), the compare view (one column and one trace per run) and the bit plan by sensitivity
(in the job view as soon as it is measured, in the run's report and its model card)."""

from __future__ import annotations

import json
import queue
import shutil
import threading
from types import SimpleNamespace

import pytest

gradio_client = pytest.importorskip("gradio_client")
import gradio as gr  # noqa: E402
from studio_helpers import LAYERS, gate_jobs, job_kwargs, make_tiny_checkpoint, serve_app, texts, wait_done  # noqa: E402
from test_app_chat import FakeSide  # noqa: E402

from vptq_core.storage.archive import pack_checkpoint  # noqa: E402
from vptq_core.studio import bit_plan, compare, views  # noqa: E402
from vptq_core.studio.run_models import Side  # noqa: E402
from vptq_core.studio.task import quantization_task  # noqa: E402

served = pytest.fixture(scope="module", name="served")(serve_app)
gated = pytest.fixture(name="gated")(gate_jobs)
tiny_checkpoint = pytest.fixture(scope="module", name="tiny_checkpoint")(make_tiny_checkpoint)


def _request(session: str) -> SimpleNamespace:
    return SimpleNamespace(session_hash=session)


def _upload(served, ckpt, request, name: str) -> str:
    archive = pack_checkpoint(ckpt, ckpt.parent / f"{name}.zip")
    copy = ckpt.parent / f"{name}-sent.zip"
    shutil.copyfile(archive, copy)
    return served.studio.uploads.upload_run(str(copy), request)


def _answer(served, request, left: str, right: str, temperature: float, seed: int, prompt: str = "Hello"):
    """Both sides' final replies (and stats lines) to ``prompt``."""
    *_, last = served.studio.chat.reply_sides(prompt, [], [], "", temperature, 1.0, 8, left, right, seed, request)
    return texts(last[0])[-1][1], texts(last[1])[-1][1], last[2], last[3]


# ------------------------------------------------------------------------------------------ run vs run
def test_two_runs_answer_alike_with_the_same_seed_and_a_run_matches_itself(served, tiny_checkpoint):
    request = _request("run-vs-run")
    a, b = (_upload(served, tiny_checkpoint, request, name) for name in ("a", "b"))  # the same weights twice
    loaded = served.studio.chat.load_sides("", a, b, request)[0]
    assert f"Left · **Quantized** run {a} of `tiny-random-llama`" in loaded
    assert f"Right · **Quantized** run {b}" in loaded
    greedy = _answer(served, request, a, b, 0.0, 0)
    assert greedy[0] and greedy[0] == greedy[1]
    sampled = _answer(served, request, a, b, 1.0, 5)
    assert sampled[0] and sampled[0] == sampled[1]
    other_seed = _answer(served, request, a, b, 1.0, 6)
    assert other_seed[0] == other_seed[1] and other_seed[0] != sampled[0]  # the seed reaches both sides
    itself = _answer(served, request, a, a, 1.0, 5)
    assert itself[:2] == sampled[:2]
    assert "tokens/s" in itself[2] and "tokens/s" in itself[3]
    # the original next to a run, as before; the decode rate of a full reply stays with the run
    orig, quant, *_ = _answer(served, request, "original", b, 0.0, 0)
    assert orig and quant == greedy[1]
    speed = served.studio.manager.get(b, request.session_hash).extras["chat_speed"]
    assert speed["tokens"] >= 2 and speed["decode_tokens_per_second"] > 0 and speed["alongside"]
    assert not served.studio.manager.get(a, request.session_hash).extras["chat_speed"]["alongside"]  # sampled: alone
    # two models that do not fit: one clear message before anything loads
    served.studio.cache.drop(lambda key: True)
    served.studio.models.free_bytes = lambda: 1000
    try:
        with pytest.raises(gr.Error, match=rf"run {a} \(about .* MB\) and run {b} \(about .* MB\) do not fit in "
                                           r"memory together: 0\.001 MB is free on cpu; pick smaller runs, or the "
                                           r"same run on both sides"):
            _answer(served, request, a, b, 0.0, 0)
    finally:
        del served.studio.models.free_bytes
    with pytest.raises(gr.Error, match=r"seed must be an integer in 0\.\.2\*\*31-1, got -1"):
        _answer(served, request, a, b, 0.0, -1)


def test_stop_on_one_side_of_a_run_vs_run_chat_leaves_the_other_streaming(served, monkeypatch):
    sides: dict[str, FakeSide] = {}

    def make_chat(model, tokenizer):
        sides[model] = FakeSide(model, tokenizer)
        return sides[model]

    monkeypatch.setattr(served.studio.chat, "make_chat", make_chat)
    monkeypatch.setattr(served.studio.models, "side_models", lambda run_id, picks, owner: [
        Side(p, (p, None), "", f"run {p}", "tiny-random-llama") for p in picks])
    request = _request("run-vs-run-stop")
    replies = served.studio.chat.reply_sides("Hi", [], [], "", 0.0, 1.0, 4, "A", "B", 3, request)
    next(replies)
    updates: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [updates.put(out) for out in replies] + [updates.put(None)], daemon=True).start()
    assert sides["A"].started.wait(5) and sides["B"].started.wait(5)
    sides["A"].steps.release()
    served.studio.chat.stop_quantized(request)  # the right side stops; the left goes on to the end
    assert sides["B"].stopped.wait(5)
    sides["A"].steps.release(3)
    final = None
    while (item := updates.get(timeout=5)) is not None:
        final = item
    assert views.message_text(final[0][-1]["content"]) == "A1 A2 A3 A4 " and "stopped" not in final[2]
    assert views.message_text(final[1][-1]["content"]) == "" and "stopped" in final[3]


# ------------------------------------------------------------------------------------------ compare runs
def test_compare_view_has_one_column_and_one_trace_per_run(served, gated):
    request = _request("compare-runs")
    owner = request.session_hash
    ids = []
    for bits in (2, 3):
        config = SimpleNamespace(to_dict=lambda b=bits: {"bits": b})
        task = gated("tiny-random-llama", "rtn", config, SimpleNamespace(to_dict=dict))
        snap = served.studio.manager.submit(owner, task, title=f"rtn {bits}", device="cpu")
        gated.runs[-1].release()
        ids.append(wait_done(served, owner, snap.id).id)
    served.studio.manager.set_extra(ids[0], owner, "eval", {"perplexity": 12.5, "kl_divergence": 0.0123,
                                                            "kl_p99": 0.5, "top1_agreement": 0.875})
    table, *figs = served.studio.compare.compare(ids, request)
    headers, rows = table.headers, {row[0]: row[1:] for row in table.value["data"]}
    assert len(headers) == 3 and all(i[:6] in h for i, h in zip(ids, headers[1:], strict=True))
    assert rows["perplexity"] == ["12.500", compare.MISSING] and rows["KL p99"] == ["0.5000", compare.MISSING]
    assert rows["KL median"] == [compare.MISSING] * 2 and rows["same top token"] == ["87.5%", compare.MISSING]
    assert rows["total bits / weight"] == ["2.500", "2.500"]
    assert len(figs) == len(compare.LAYER_METRICS)
    for fig, (key, _title, _log) in zip(figs, compare.LAYER_METRICS, strict=True):
        assert [t.name for t in fig.data] == headers[1:]
        assert all(len(t.x) == (2 if key == "rel_output_error" else LAYERS) for t in fig.data)
    proxy = figs[0].data[0]
    assert list(proxy.y) == pytest.approx([0.001 * (i + 1) for i in range(LAYERS)])
    assert proxy.x[0] == 0 and proxy.x[7] == 1 and 0 < proxy.x[1] < 1  # a block's layers between its block
    choices = served.studio.compare.choices([ids[0], "gone"], request)
    assert choices.value == [ids[0]] and [c[1] for c in choices.choices] == ids
    with pytest.raises(gr.Error, match=r"pick at most 6 runs to compare, got 7"):
        served.studio.compare.compare([f"r{i}" for i in range(7)], request)


# ----------------------------------------------------------------------------------------- the bit plan
def test_bit_plan_shows_as_soon_as_measured_and_stays_in_the_report_and_card(served, monkeypatch):
    events: list = []

    def recording_task(*args, **kwargs):
        task = quantization_task(*args, **kwargs)

        def run(ctx):
            class Ctx:  # the job's context, each plan and layer noted in the order they arrive
                def __getattr__(self, name):
                    return getattr(ctx, name)

                def on_metrics(self, phase, metrics):
                    events.append(("plan", phase))
                    ctx.on_metrics(phase, metrics)

                def on_layer(self, report):
                    events.append(("layer", report.name))
                    ctx.on_layer(report)

            return task(Ctx())
        return run

    monkeypatch.setattr(served.studio.runs, "make_task", recording_task)
    request = _request("bit-plan")
    owner = request.session_hash
    kwargs = job_kwargs(method="vptq", vector_len=4, num_centroids=256, kmeans_iters=2, bits_budget=4.0,
                        allocation="sensitivity", calib_samples=4, calib_seqlen=32)
    job = served.studio.runs.start(*[kwargs.pop(k) for k in ("model", "custom_model", "method", "calib_source",
                                                             "calib_file", "calib_samples", "calib_seqlen")],
                                   request, **kwargs)[0]
    snap = served.studio.manager.wait(job, owner, timeout=120)
    assert snap.status == "done", snap.error
    assert events[0] == ("plan", "allocation") and len(events) == 1 + LAYERS  # the plan before the first layer
    live = bit_plan.plan_of(snap.extras["model_metrics"])
    running = SimpleNamespace(result=None, extras=snap.extras)  # the job while it runs: the plan from its extras
    assert bit_plan.plan_of(bit_plan.snapshot_metrics(running)) == live
    report = json.loads((served.studio.manager.checkpoint_dir(job, owner) / "quant_report.json").read_text())
    kept = bit_plan.report_plan(report)
    assert kept == live and len(kept) == LAYERS
    planned = {(p["block"], p["module"]): p for p in kept}
    for layer in report["layers"]:  # every layer was quantized as planned, at the planned bits
        p = planned[(layer["block"], layer["module"])]
        assert layer["total_bits"] == pytest.approx(p["total_bits"])
        assert layer["index_bits"] == pytest.approx(p["index_bits"])
    plot, shown = served.studio.bit_plan.show(job, "", request)
    heat = plot.value["plot"] if isinstance(plot.value, dict) else plot.value
    assert plot.visible and shown and served.studio.bit_plan.show(job, shown, request)[0] == gr.skip()
    z = json.loads(heat)["data"][0]["z"] if isinstance(heat, str) else heat.data[0].z
    assert sorted(v for row in z for v in row) == pytest.approx(sorted(p["total_bits"] for p in kept))
    card = (served.studio.manager.checkpoint_dir(job, owner) / "README.md").read_text()
    assert "## Bit plan" in card
    first = planned[(0, "self_attn.q_proj")]
    assert f"| 0 | {first['total_bits']:.2f} (v{first['vector_len']} k{first['num_centroids']}) |" in card
    assert len([line for line in card.splitlines() if line.startswith(("| 0 |", "| 1 |"))]) == 2
    hidden, _ = served.studio.bit_plan.show("", shown, request)  # no job (or a run without a plan): no plot
    assert hidden.visible is False

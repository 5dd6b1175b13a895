import copy
import dataclasses
import math

import pytest
import torch

from vptq_core.quant import sampling as sampling_mod
from vptq_core.quant.config import ScalarConfig, VPTQConfig
from vptq_core.quant.pipeline import quantize_model
from vptq_core.quant.sampling import sample_windows, sampled_calibration
from vptq_core.quant.teacher import teacher_topk


class _Clock:
    """A stand-in for the ``time`` module whose perf_counter advances one second a call (every token costs 1 s), or
    ``slow`` seconds a call after the first ``calls`` calls."""

    def __init__(self, calls: int = 0, slow: float = 1.0) -> None:
        self.now, self.calls, self.after, self.slow = 0.0, 0, calls, slow

    def perf_counter(self) -> float:
        self.calls += 1
        self.now += self.slow if self.after and self.calls > self.after else 1.0
        return self.now


@pytest.fixture(scope="module")
def windows() -> torch.Tensor:
    return torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(2))


def test_sampled_windows_follow_the_model_and_are_reproducible(tiny_model):
    model, _ = tiny_model
    starts = torch.tensor([[5], [7], [9]])
    a = sample_windows(model, starts, 24, seed=3, batch=2)
    assert a.shape == (3, 24) and a.dtype == torch.long
    assert torch.equal(a[:, :1], starts)
    assert torch.equal(a, sample_windows(model, starts, 24, seed=3, batch=3))  # batching does not change rows
    # rows name the row numbers: a subset of a draw is exactly those rows of the draw
    assert torch.equal(a[[0, 2]], sample_windows(model, starts[[0, 2]], 24, seed=3, rows=torch.tensor([0, 2])))
    with pytest.raises(ValueError, match="rows must name one row number per start"):
        sample_windows(model, starts, 24, rows=torch.tensor([0, 1]))
    assert not torch.equal(a, sample_windows(model, starts, 24, seed=4))
    # ancestral sampling: every sampled token has the probability the model gives it after its prefix > 0,
    # and at a tiny temperature sampling is greedy decoding
    greedy = sample_windows(model, starts, 24, seed=0, temperature=1e-4)
    with torch.no_grad():
        logits = model(greedy, use_cache=False).logits[:, :-1]
    torch.testing.assert_close(greedy[:, 1:], logits.argmax(-1), rtol=0, atol=0)
    # the teacher recorded while sampling is the teacher's own pass over the finished windows
    windows, teacher = sample_windows(model, starts, 24, seed=3, topk=7)
    assert torch.equal(windows, a)
    again = teacher_topk(model, windows, 7, torch.device("cpu"))
    assert teacher["logp"].shape == (3, 23, 7)
    torch.testing.assert_close(teacher["logp"], again["logp"], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(teacher["rest"], again["rest"], rtol=1e-4, atol=1e-5)
    assert torch.equal(teacher["index"], again["index"])
    with pytest.raises(ValueError, match="starts must be token ids"):
        sample_windows(model, torch.tensor([1, 2]), 24)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        sample_windows(model, starts, 24, temperature=0)


def test_sampling_in_bf16_is_the_model_with_bf16_parameters(tiny_model, monkeypatch):
    """sample_dtype: "bfloat16" runs a float32 model through bf16 copies of its parameters (the module itself is
    left as it is): the same windows and teacher as a copy whose parameters were cast to bf16 (buffers kept);
    "auto" does so only where the hardware multiplies bf16 (device.native_bf16), "model" never."""
    model, _ = tiny_model
    starts = torch.tensor([[5], [7], [9]])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    cast = copy.deepcopy(model)
    for p in cast.parameters():
        p.data = p.data.to(torch.bfloat16)
    got, got_teacher = sample_windows(model, starts, 24, seed=3, topk=5, dtype="bfloat16")
    want, want_teacher = sample_windows(cast, starts, 24, seed=3, topk=5, dtype="model")
    assert torch.equal(got, want)
    for key in ("logp", "index", "rest"):
        assert torch.equal(got_teacher[key], want_teacher[key]), key
    assert all(torch.equal(p, before[n]) and p.dtype == torch.float32 for n, p in model.named_parameters())
    assert sampling_mod.sampling_dtype(model, "model") is None
    assert sampling_mod.sampling_dtype(cast, "bfloat16") is None  # already bf16: nothing to copy
    for native, expected in ((True, torch.bfloat16), (False, None)):
        monkeypatch.setattr(sampling_mod, "native_bf16", lambda _device, _v=native: _v)
        assert sampling_mod.sampling_dtype(model, "auto") is expected
        # the default is one precision on every machine: float32, whatever the hardware multiplies
        assert sampling_mod.sampling_dtype(model) is None and sampling_mod.sampling_dtype(model, "float32") is None
        assert sampling_mod.sampling_dtype(cast) is torch.float32  # a bf16 model is written from float32 copies
    assert VPTQConfig().sample_dtype == ScalarConfig().sample_dtype == sampling_mod.DEFAULT_SAMPLE_DTYPE == "float32"
    with pytest.raises(ValueError, match="sample_dtype must be one of"):
        sampling_mod.sampling_dtype(model, "float16")
    with pytest.raises(ValueError, match="sample_dtype must be 'float32', 'bfloat16', 'model' or 'auto'"):
        VPTQConfig(sample_dtype="fp16")


def test_a_bf16_model_writes_in_float32_by_default(tiny_model):
    """The default precision: a bf16 model writes the windows a float32 copy of it writes, its own parameters
    untouched."""
    model, _ = tiny_model
    starts = torch.tensor([[5], [7]])
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    widened = copy.deepcopy(bf16).float()
    got = sample_windows(bf16, starts, 16, seed=1, dtype="float32")
    assert torch.equal(got, sample_windows(widened, starts, 16, seed=1, dtype="model", pack=False))
    assert all(p.dtype == torch.bfloat16 for p in bf16.parameters())


def test_repeated_share_tells_a_loop_from_text():
    from vptq_core.quant.repetition import MAX_REPEATED_SHARE, degenerate, repeated_share

    loop = torch.tensor([11, 12, 13, 14, 15, 16, 17] * 40)  # a 7-token phrase over and over
    stuck = torch.cat([torch.arange(100, 200), torch.full((180,), 9)])  # 100 tokens, then one token repeated
    text = torch.randperm(5000, generator=torch.Generator().manual_seed(0))[:280]
    assert repeated_share(loop) == pytest.approx((280 - 3 - 7) / (280 - 3))  # every 4-gram after the first 7 repeats
    assert repeated_share(stuck) == pytest.approx((180 - 4) / (280 - 3))
    assert repeated_share(text) == 0.0 and repeated_share(torch.tensor([1, 1, 1, 1])) == 0.0
    assert degenerate(torch.stack([loop, stuck, text])).tolist() == [True, True, False]
    assert repeated_share(loop) > MAX_REPEATED_SHARE > repeated_share(text)


def test_degenerate_windows_are_redrawn_and_stay_text_when_they_stay_degenerate(tiny_model, windows, monkeypatch):
    """sample_windows(max_repeated=...) draws a looping row again from a fresh generator (rows + REDRAW_ROWS), the
    teacher with it; sampled_calibration keeps the text window for a row that loops after every redraw, and under a
    time budget redraws only what fits the writing's share of it."""
    from vptq_core.quant.calib_windows import written_rows

    model, _ = tiny_model
    starts = torch.tensor([[5], [7], [9]])
    plain, teacher = sample_windows(model, starts, 24, seed=3, topk=4)
    real_write = sampling_mod._write
    calls = []

    def looping_first(reference, starts, seqlen, seed, batch, temperature, should_stop, topk, device, rows, *rest):
        got = real_write(reference, starts, seqlen, seed, batch, temperature, should_stop, topk, device, rows, *rest)
        calls.append(rows.tolist())
        if len(calls) == 1:  # the first draw of row 1 loops
            (got[0] if topk else got)[1] = torch.tensor([7, 1, 2] * seqlen)[:seqlen]
        return got

    monkeypatch.setattr(sampling_mod, "_write", looping_first)
    got, got_teacher = sample_windows(model, starts, 24, seed=3, topk=4, max_repeated=0.5)
    assert calls == [[0, 1, 2], [1 + sampling_mod.REDRAW_ROWS]]
    assert torch.equal(got[[0, 2]], plain[[0, 2]]) and not torch.equal(got[1], plain[1])
    redrawn, redrawn_teacher = real_write(model, starts[1:2], 24, 3, 8, 1.0, None, 4, None,
                                          torch.tensor([1 + sampling_mod.REDRAW_ROWS]), "model", True)
    assert torch.equal(got[1:2], redrawn)
    for key in ("logp", "index", "rest"):
        assert torch.equal(got_teacher[key][[0, 2]], teacher[key][[0, 2]]), key
        # redrawn alone, not in a batch of three: float rounding may differ
        torch.testing.assert_close(got_teacher[key][1:2], redrawn_teacher[key].detach(), rtol=1e-4, atol=1e-5)
    # without max_repeated nothing is screened
    calls.clear()
    assert torch.equal(sample_windows(model, starts, 24, seed=3, max_repeated=None)[1], torch.tensor([7, 1, 2] * 8))

    def always_looping(reference, starts, seqlen, *args):
        return torch.cat([starts, torch.full((starts.shape[0], seqlen - starts.shape[1]), 4)], dim=1)

    monkeypatch.setattr(sampling_mod, "_write", always_looping)
    cfg = ScalarConfig(bits=3, group_size=16, calib_sampled_share=0.5)
    info: dict = {}
    out = sampled_calibration(model, windows, cfg, info=info)
    assert torch.equal(out, windows) and info == {"degenerate_kept_text": 4}
    # under a budget a redraw is drawn only when it fits the writing's share: here the writing itself fits its 20%
    # (1 s a poll, 64 polls), a redraw of the 4 rows would not
    calls.clear()
    monkeypatch.setattr(sampling_mod, "_write", looping_first)
    monkeypatch.setattr(sampling_mod, "time", _Clock())
    info = {}
    out = sampled_calibration(model, windows, dataclasses.replace(cfg, time_budget=100.0 / 0.2), info=info)
    assert len(calls) == 1 and info == {"redraws_skipped": 1, "degenerate_kept_text": 1}
    assert torch.equal(out[written_rows(8, cfg)[1]], windows[written_rows(8, cfg)[1]])
    calls.clear()
    monkeypatch.setattr(sampling_mod, "time", _Clock())
    info = {}
    sampled_calibration(model, windows, dataclasses.replace(cfg, time_budget=200.0 / 0.2), info=info)
    assert len(calls) == 2 and info == {}  # room for the redraw: drawn again, and no longer a loop


def test_sampled_calibration_replaces_the_last_block_stage_windows(tiny_model, windows):
    """calib_sampled_share: the last share of the windows the block stage sees are the original model's own
    samples (started from the replaced windows' first tokens, reproducible, not distillation's draws); the text
    windows before them and distillation's held-out windows after them stay as they were."""
    from vptq_core.quant.calib_windows import sampled_count
    from vptq_core.quant.sampling import CALIB_SAMPLE_ROWS

    model, _ = tiny_model
    cfg = ScalarConfig(bits=3, group_size=16, calib_sampled_share=0.5, distill_iters=2, distill_holdout=0.25,
                       sample_dtype="model")  # float32 as sample_windows below, on bf16 hardware too
    got = sampled_calibration(model, windows, cfg)  # 8 windows: 6 for the blocks (3 sampled), 2 held out
    assert torch.equal(got[:3], windows[:3]) and torch.equal(got[6:], windows[6:])
    assert torch.equal(got[3:6, 0], windows[3:6, 0]) and not torch.equal(got[3:6], windows[3:6])
    expect = sample_windows(model, windows[3:6, :1], 64, seed=0, rows=torch.arange(3, 6) + CALIB_SAMPLE_ROWS)
    assert torch.equal(got[3:6], expect)
    assert torch.equal(sampled_calibration(model, windows, cfg), got)
    assert not torch.equal(sample_windows(model, windows[3:6, :1], 64, seed=0), got[3:6])  # distillation's rows
    off = dataclasses.replace(cfg, calib_sampled_share=0.0)
    assert sampled_calibration(model, windows, off) is windows
    # the share rounds half up, and a share > 0 samples at least one window
    share = dataclasses.replace(off, calib_sampled_share=0.5)
    assert [sampled_count(n, share) for n in (0, 1, 2, 5, 6, 32)] == [0, 1, 1, 3, 3, 16]
    assert sampled_count(32, dataclasses.replace(off, calib_sampled_share=0.01)) == 1
    assert sampled_count(32, dataclasses.replace(off, calib_sampled_share=1.0)) == 32
    assert sampled_count(32, off) == 0
    with pytest.raises(ValueError, match=r"calib_sampled_share must be in \[0\.0, 1\.0\], got 1\.5"):
        dataclasses.replace(cfg, calib_sampled_share=1.5)
    assert sampled_calibration(model, windows, cfg, should_stop=lambda: True) is None


def test_self_written_windows_stay_text_when_too_slow_for_the_time_budget(tiny_model, windows):
    """Under a time_budget the writing may take SAMPLING_BUDGET_SHARE of it, projected from its first tokens:
    over it every window stays text (and says why); within it the windows are written as without a budget. The
    pipeline records the decision, and the time estimate leaves the writing out by the same rule."""
    from vptq_core.quant.calib_windows import sampled_count
    from vptq_core.studio import estimate as est

    model, _ = tiny_model
    cfg = ScalarConfig(bits=3, group_size=16, calib_sampled_share=0.5, distill_iters=2, distill_holdout=0.25)
    info: dict = {}
    got, teacher = sampled_calibration(model, windows, dataclasses.replace(cfg, time_budget=1e-3), topk=4,
                                       info=info)
    assert got is windows and teacher is None
    assert info["self_written"] == 0 and info["limit_seconds"] == 0.0  # 20% of 1 ms, rounded to 0.1 s
    assert info["projected_seconds"] >= info["limit_seconds"]
    assert "calibration stays text" in info["reason"]
    roomy: dict = {}
    assert torch.equal(sampled_calibration(model, windows, dataclasses.replace(cfg, time_budget=1e6), info=roomy),
                       sampled_calibration(model, windows, cfg)) and not roomy
    _, result = quantize_model(copy.deepcopy(model), windows, "rtn",
                               dataclasses.replace(cfg, distill_iters=0, time_budget=1e-3))
    assert result.model_metrics["calibration"]["self_written"] == 0
    # the estimate: where the writing would exceed its share of the budget the run is priced without it
    def shaped(hidden: int, blocks: int) -> est.ModelInfo:
        shapes = ((hidden, hidden), (hidden // 4, hidden), (hidden // 4, hidden), (hidden, hidden),
                  (4 * hidden, hidden), (4 * hidden, hidden), (hidden, 4 * hidden)) * blocks
        return est.ModelInfo(name="synthetic", num_blocks=blocks, modules=("q", "k", "v", "o", "g", "u", "d"),
                             linear_shapes=shapes, other_params=50_000 * hidden)

    preset = VPTQConfig(vector_len=6, num_centroids=4096, calib_sampled_share=0.75, distill_iters=48,
                        distill_data="calibration", time_budget=570.0)
    text = dataclasses.replace(preset, calib_sampled_share=0.0)
    big, small = shaped(2048, 24), shaped(64, 2)
    params = big.linear_weights + big.other_params
    assert est.sampling_estimate(params, sampled_count(32, preset), 512) > \
        sampling_mod.SAMPLING_BUDGET_SHARE * preset.time_budget
    assert est.time_estimate(big, preset, 32, 512) == est.time_estimate(big, text, 32, 512)
    assert est.time_estimate(small, preset, 32, 512) != est.time_estimate(small, text, 32, 512)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_writing_a_little_over_its_share_goes_on_with_the_windows_that_fit(family, windows, monkeypatch):
    """Projected over SAMPLING_BUDGET_SHARE of the budget at the growth-aware decision, the writing goes on with as
    many of its windows as fit (the first ones, each exactly as without a budget, the teacher too) and the others
    stay text; fewer than MIN_WRITTEN_SHARE of them fitting, every window stays text. Both decoders drop the rows
    they no longer write: the lean one (llama) and the model's own cache (gemma3)."""
    from vptq_core.models import tiny_random_model
    from vptq_core.quant.calib_windows import written_rows
    from vptq_core.quant.sampling import MIN_WRITTEN_SHARE, SAMPLING_BUDGET_SHARE

    model, _ = tiny_random_model(family)
    cfg = ScalarConfig(bits=3, group_size=16, calib_sampled_share=1.0, distill_iters=2, distill_holdout=0.25)
    rows = written_rows(windows.shape[0], cfg)
    planned = rows.numel()
    assert planned == 6
    full, full_teacher = sampled_calibration(model, windows, cfg, topk=4)
    # every token costs 1 s and n windows n / 6 of 6: the projection at the decision (16 tokens in) is the
    # window's 63 tokens, and the windows that fit are those whose remaining ~47 s, scaled by n / 6, fit
    tokens = windows.shape[1] - 1
    monkeypatch.setattr(sampling_mod, "sampling_ratio", lambda n, of: n / of)
    for limit, fit in ((0.9 * tokens, 5), (0.7 * tokens, 3)):
        monkeypatch.setattr(sampling_mod, "time", _Clock())
        info: dict = {}
        budgeted = dataclasses.replace(cfg, time_budget=limit / SAMPLING_BUDGET_SHARE)
        got, teacher = sampled_calibration(model, windows, budgeted, topk=4, info=info)
        assert info["self_written"] == fit and info["planned"] == planned
        assert info["reason"].endswith(f"{fit} written, {planned - fit} stay text")
        kept = rows[:fit]
        assert torch.equal(got[kept], full[kept])  # the rows written are those of the writing without a budget
        assert torch.equal(got[rows[fit:]], windows[rows[fit:]])  # the others stay text
        others = torch.ones(windows.shape[0], dtype=torch.bool)
        others[rows] = False
        assert torch.equal(got[others], windows[others])  # and the windows never to be written too
        assert torch.equal(teacher["rows"], kept)
        for key in ("logp", "index", "rest"):
            torch.testing.assert_close(teacher[key], full_teacher[key][:fit], rtol=1e-5, atol=1e-6)
    # under half of them fitting: all text
    assert math.ceil(MIN_WRITTEN_SHARE * planned) == 3
    monkeypatch.setattr(sampling_mod, "time", _Clock())
    info = {}
    got, teacher = sampled_calibration(model, windows, dataclasses.replace(
        cfg, time_budget=0.5 * tokens / SAMPLING_BUDGET_SHARE), topk=4, info=info)
    assert got is windows and teacher is None and info["self_written"] == 0
    assert info["reason"].endswith("fewer than 50% of them fit, the calibration stays text")
    # tokens 3x dearer from the 13th on, as in a busy moment of the machine: the fitted growth (capped at twice the
    # mean cost so far) says fewer than half fit, the mean cost so far does not: it goes on with half, not none
    monkeypatch.setattr(sampling_mod, "time", _Clock(calls=13, slow=3.0))
    info = {}
    got, teacher = sampled_calibration(model, windows, dataclasses.replace(
        cfg, time_budget=80.0 / SAMPLING_BUDGET_SHARE), topk=4, info=info)
    assert info["self_written"] == 3 and info["projected_seconds"] > 150.0  # the fit: ~2x the mean cost's ~100 s
    assert torch.equal(got[rows[:3]], full[rows[:3]])
    assert torch.equal(got[rows[3:]], windows[rows[3:]])


def test_windows_that_fit_take_the_most_that_fit_down_to_the_floor():
    from vptq_core.quant.cost import sampling_seconds
    from vptq_core.quant.sampling import SAMPLE_BATCH, sampling_ratio, windows_that_fit

    cost = {n: 10.0 * n for n in range(25)}
    assert windows_that_fit(24, cost.get, 240.0) == 24
    assert windows_that_fit(24, cost.get, 239.0) == 23
    assert windows_that_fit(24, cost.get, 120.0) == 12
    assert windows_that_fit(24, cost.get, 119.0) == 0  # fewer than half: none
    assert windows_that_fit(1, cost.get, 5.0) == 0
    # a batched pass costs much the same for fewer windows: half of them cost well over half as much
    assert 0.5 < sampling_ratio(12, 24) < 1.0 and sampling_ratio(24, 24) == 1.0
    assert sampling_ratio(SAMPLE_BATCH + 1, SAMPLE_BATCH) > 1.5  # a second pass
    # the ratio is that of the seconds the plan prices the writing at
    assert sampling_ratio(20, 24) == pytest.approx(sampling_seconds(135e6, 20, 512) / sampling_seconds(135e6, 24, 512))
    assert sampling_seconds(135e6, 0, 512) == 0.0


def test_writing_projection_allows_for_tokens_growing_dearer_along_the_window():
    """Tokens cost more further along the window. The early decisions (PROJECT_AFTER polls and the doublings) use
    the mean cost so far, a lower bound of the total; the one at a quarter of the first window fits the growth and
    projects the total closely, also under timing noise and a short busy spell, and never more than GROWTH_CAP x
    the mean-cost projection when a long one throws the fit off; after it there is no decision."""
    from vptq_core.quant.sampling import GROWTH_CAP, PROJECT_AFTER, WritingProjection

    per_batch, setup, warm = 511, 0.25, 0.5
    final = per_batch // 4

    def run(batches: int, a: float, b: float, noise: float = 0.0, busy: range = range(0)):
        gen = torch.Generator().manual_seed(0)
        projection, now, got = WritingProjection(per_batch, batches, start=0.0), setup, {}
        for k in range(1, per_batch * batches + 1):
            projected = projection.poll(now)
            if projected is not None:
                got[k] = projected
            pos = (k - 1) % per_batch
            jitter = 1 + noise * float(torch.randn((), generator=gen))
            now += (a + b * pos) * jitter * (4.0 if k in busy else 1.0) + (warm if k == 1 else 0.0)
        return got, now, projection

    # Gemma-3-270M-like: 0.15 s a token at the start, 2.4x that at the end of the window
    for batches in (1, 3):
        got, total, _ = run(batches, 0.15, 4e-4)
        assert sorted(got) == [PROJECT_AFTER, 2 * PROJECT_AFTER, 4 * PROJECT_AFTER, final]
        assert got[final] == pytest.approx(total, rel=0.01)
        # the early ones are lower bounds: the growth is still ahead
        assert all(got[k] < total for k in got if k != final)
    noisy, total, _ = run(1, 0.15, 4e-4, noise=0.3)
    assert noisy[final] == pytest.approx(total, rel=0.1)
    # a busy spell of 11 tokens moves the medians' fit little; one over the whole last quarter is capped
    short, total, _ = run(1, 0.05, 0.0, busy=range(110, 121))
    assert short[final] == pytest.approx(total, rel=0.05)
    long, total, projection = run(1, 0.05, 0.0, busy=range(90, 128))
    assert long[final] == pytest.approx(GROWTH_CAP * projection.flat()) and long[final] < 4 * total
    # a writing too short to reach a decision is never stopped by one
    tiny = WritingProjection(8, 1, start=0.0)
    assert all(tiny.poll(float(k)) is None for k in range(8))


def test_the_block_stage_calibrates_on_the_sampled_windows(tiny_model, windows):
    """GPTQ with calib_sampled_share = GPTQ on the windows sampled_calibration returns (codes equal), not on the
    text's; the sampling's time is its own phase, a cancel during it marks the run, streamed weights are refused."""
    model, _ = tiny_model
    text = ScalarConfig(bits=3, group_size=16)
    cfg = dataclasses.replace(text, calib_sampled_share=0.5)
    _, sampled = quantize_model(model, windows, "gptq", cfg)
    _, same = quantize_model(model, sampled_calibration(model, windows, cfg), "gptq", text)
    _, plain = quantize_model(model, windows, "gptq", text)
    for name, st in sampled.states.items():
        assert torch.equal(st.codes, same.states[name].codes), name
    assert any(not torch.equal(st.codes, plain.states[name].codes) for name, st in sampled.states.items())
    assert sampled.timings["sample_calibration"] > 0 and "sample_calibration" not in plain.timings
    _, stopped = quantize_model(model, windows, "gptq", cfg, should_stop=lambda: True)
    assert stopped.cancelled and not stopped.states
    with pytest.raises(ValueError, match="calib_sampled_share.*not possible with streamed weights"):
        quantize_model(model, windows, "gptq", cfg, weights=object())


def test_quantize_to_dir_loads_the_whole_model_for_sampled_calibration(tmp_path):
    from vptq_core.api import quantize_to_dir
    from vptq_core.quant.config import CalibConfig

    cfg = ScalarConfig(bits=4, group_size=16, calib_sampled_share=0.5)
    with pytest.raises(ValueError, match="cannot stream block by block with calib_sampled_share"):
        quantize_to_dir("tiny-random-llama", "rtn", cfg, CalibConfig(samples=4, seqlen=32), tmp_path / "a",
                        device="cpu", stream=True)
    _, summary = quantize_to_dir("tiny-random-llama", "gptq", cfg, CalibConfig(samples=4, seqlen=32), tmp_path / "b",
                                 device="cpu")
    assert summary["streaming"].startswith("off: calib_sampled_share") and summary["timings"]["sample_calibration"] > 0


def test_draw_follows_the_distribution_and_never_picks_a_zero(monkeypatch):
    from vptq_core.quant.sampling import _draw

    p = torch.tensor([[0.5, 0.0, 0.3, 0.2, 0.0, 0.0]])
    gen = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.cat([_draw(p.log(), 1.0, [gen])[0] for _ in range(4000)]), minlength=6)
    assert counts[[1, 4, 5]].sum() == 0
    torch.testing.assert_close(counts.float() / 4000, p[0], rtol=0, atol=0.03)
    # u at the very top (rounding): the last token with probability > 0, not one past the end
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.ones(1))
    assert _draw(p.log(), 1.0, [gen]).tolist() == [[3]]
    two = torch.tensor([[0.0, 1.0, 0.0], [0.6, 0.4, 0.0]]).log()
    assert _draw(two, 1.0, [gen, gen]).tolist() == [[1], [1]]


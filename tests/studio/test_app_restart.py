"""A restart in the middle of a session with no ``VPTQ_APP_SECRET`` set: the key the page stores its identity
with is kept in the work directory (mode 0600), so the page reads its identity back after the restart and the
browser finds its runs, downloads and evaluations; a job the restart cut off, even before its first block, comes
back as interrupted with Resume."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

gradio_client = pytest.importorskip("gradio_client")
from studio_helpers import GatedRun, job_kwargs, make_tiny_checkpoint  # noqa: E402

import app as studio_app  # noqa: E402
from vptq_core.models import TINY  # noqa: E402
from vptq_core.storage.archive import pack_checkpoint  # noqa: E402
from vptq_core.studio import handlers, views  # noqa: E402
from vptq_core.studio.browser_secret import SECRET_FILE, stored_secret  # noqa: E402

tiny_checkpoint = pytest.fixture(scope="module", name="tiny_checkpoint")(make_tiny_checkpoint)


class Killed(BaseException):
    """Stands in for the process dying: not an Exception, so the job thread ends without any cleanup."""


def _page(session: str) -> SimpleNamespace:
    return SimpleNamespace(session_hash=session)


def _page_secret(demo) -> str:
    found = [c["props"]["secret"] for c in demo.get_config_file()["components"] if c["type"] == "browserstate"]
    assert len(found) == 1
    return found[0]


def test_the_browser_key_is_made_once_private_and_kept(tmp_path: Path):
    key = stored_secret(tmp_path)
    path = tmp_path / SECRET_FILE
    assert len(key) >= 43 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stored_secret(tmp_path) == key
    keys: list[str] = []
    threads = [threading.Thread(target=lambda: keys.append(stored_secret(tmp_path / "fresh"))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(keys) == 8 and len(set(keys)) == 1  # processes starting at once agree on one key
    assert [p.name for p in (tmp_path / "fresh").iterdir()] == [SECRET_FILE]  # no temporary file left
    path.write_text("short", encoding="ascii")  # damaged: replaced
    replaced = stored_secret(tmp_path)
    assert replaced != key and len(replaced) >= 43 and stat.S_IMODE(path.stat().st_mode) == 0o600
    # The page gets the kept key, or the operator's when one is set.
    settings = studio_app.AppSettings(workdir=tmp_path, default_model=TINY)
    assert _page_secret(studio_app.build_app(settings)) == replaced
    chosen = studio_app.AppSettings(workdir=tmp_path, default_model=TINY, browser_secret="operator-chosen-key")
    assert _page_secret(studio_app.build_app(chosen)) == "operator-chosen-key"


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_restart_mid_session_without_a_secret_keeps_runs_downloads_evaluations(tmp_path, tiny_checkpoint):
    assert not os.environ.get("VPTQ_APP_SECRET")
    settings = studio_app.AppSettings(workdir=tmp_path / "work", default_model=TINY, eval_windows=1, eval_seqlen=16)
    gated: list[GatedRun] = []
    dying = threading.Event()

    def make_task(model, method, config, calib, device="cpu", calib_text=None, resume=False):
        run = GatedRun(model, method, config, calib, calib_text)
        gated.append(run)
        if not dying.is_set():
            return run.task

        def dies(ctx):  # the process dies at its first layer
            ctx.on_layer = lambda report: (_ for _ in ()).throw(Killed)
            return run.task(ctx)

        return dies

    demo = studio_app.build_app(settings, handlers.Studio(settings, make_task=make_task))
    before = demo.studio
    identity = before.pages.attach(None, _page("page-1"))[0]
    # An uploaded run, evaluated; a finished run, downloaded.
    archive = pack_checkpoint(tiny_checkpoint, tmp_path / "tiny.zip")
    uploaded = before.uploads.upload_run(str(archive), _page("page-1"))
    evaluation = before.evaluation.evaluate_run(uploaded, 1, 16, _page("page-1"), progress=lambda *a, **k: None)[0]
    assert "Perplexity" in evaluation
    done = before.runs.start(**job_kwargs(), request=_page("page-1"))[0]
    gated[-1].release()
    assert before.manager.wait(done, identity, timeout=30).status == "done"
    downloaded = Path(before.downloads.download(done, _page("page-1"))).read_bytes()
    # A run the restart cuts off while it is still on its first block (nothing written to resume from).
    dying.set()
    cut = before.runs.start(**job_kwargs(), request=_page("page-1"))[0]
    dying.clear()
    gated[-1].release(1)
    before.manager._threads[cut].join(30)
    assert before.manager.get(cut, identity).status == "running"  # nobody noticed: the process is gone
    before.close()

    # The restart: the app is built again on the same work directory, with no secret set.
    again = studio_app.build_app(settings, handlers.Studio(settings, make_task=make_task))
    after = again.studio
    try:
        assert _page_secret(again) == _page_secret(demo) == stored_secret(settings.workdir)
        stranger = after.pages.attach(None, _page("page-9"))
        assert stranger[1] == "" and stranger[5] == []
        ident, watched, poll_state, timer, ev, rows, *_ = after.pages.attach(identity, _page("page-2"))
        assert (ident, watched) == (identity, cut) and timer.active
        assert sorted(r[0] for r in rows) == sorted([uploaded, done])
        tick = after.runs.poll(cut, poll_state, _page("page-2"))
        assert 'data-status="interrupted"' in tick[0] and "0 of 2 blocks done" in tick[0]
        assert "press Resume" in tick[0] and not tick[-1].active
        assert views.eval_md(after.manager.get(uploaded, identity).extras["eval"]) == evaluation
        again_bytes = Path(after.downloads.download(done, _page("page-2"))).read_bytes()
        assert again_bytes == downloaded
        # Resume runs it again from the start, in its own directory.
        out = after.runs.resume(cut, _page("page-2"))
        assert out[0] == cut and out[9].active
        gated[-1].release()
        resumed = after.manager.wait(cut, identity, timeout=30)
        assert resumed.status == "done" and resumed.layers_done == 14
    finally:
        after.manager.shutdown(timeout=10)
        after.close()

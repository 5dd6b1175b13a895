"""The Evaluate section's standard-tasks panel (gradio_client, in-process): a finished tiny run scored on a local
lm-eval task next to its original, the numbers lm-eval gives the models the app holds; bad input and unknown
tasks refused in one line."""

from __future__ import annotations

import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("gradio_client")
from gradio_client import Client  # noqa: E402
from gradio_client.exceptions import AppError  # noqa: E402
from lm_eval_task import TASK, write_tasks  # noqa: E402
from studio_helpers import finished, job_kwargs, serve_app  # noqa: E402

from vptq_core.models import TINY  # noqa: E402
from vptq_core.tasks import TaskSettings, task_manager, task_scores  # noqa: E402

served = pytest.fixture(scope="module", name="served")(serve_app)


@pytest.mark.slow  # a served app, a real run and lm-eval twice
def test_tasks_panel(served, tmp_path):
    served.studio.tasks.include_path = str(write_tasks(tmp_path))
    client = Client(served.url, verbose=False)
    with pytest.raises(AppError, match=r"^documents per task must be in 1\.\.1000, got 0$"):
        client.predict("anything", TASK, 0, api_name="/tasks")
    job = client.predict(**job_kwargs(method="rtn", bits=4), api_name="/start")[0]
    assert finished(served, client, job)["status"] == "done"
    with pytest.raises(AppError, match=r"^unknown lm-eval task 'no_such_task_here' \(not among its \d+ installed"):
        client.predict(job, "no_such_task_here", 4, api_name="/tasks")
    shown = client.predict(job, TASK, 4, api_name="/tasks")
    assert "| task | metric | original | quantized | Δ |" in shown and "limit 4" in shown
    manager, settings = task_manager(served.studio.tasks.include_path), TaskSettings(limit=4)
    (qmodel, tok), (original, _), _why, source = served.studio.models.run_models(job, client.session_hash)
    assert source == TINY
    q, o = (task_scores(m, tok, [TASK], settings, manager)[(TASK, "acc")] for m in (qmodel, original))
    assert f"| {TASK} | acc | {o[0]:.4f} ± {o[1]:.4f} | {q[0]:.4f} ± {q[1]:.4f} |" in shown
    client.close()

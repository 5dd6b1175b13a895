"""The app's event handlers (``Studio``), composed of one group per concern; every handler works on the jobs
and runs of the calling browser only (``services``).

- ``pages`` (``session.Pages``): a page attaching to its browser's identity, unloading; the janitor
- ``quantize_form`` (``quantize_form.QuantizeForm``): model note, live estimate, presets, model defaults
- ``runs`` (``runs.Runs``): start, resume, cancel, poll, job status, runs table, delete
- ``downloads`` (``downloads.Downloads``): per-request copies of a run's archive
- ``evaluation`` (``evaluation.Evaluation``): a run against its original model
- ``hub`` (``hub.HubPush``): push a run to the user's own hub repo
- ``uploads`` (``uploads.Uploads``): a packed checkpoint archive as a new run
- ``chat`` (``chat_handlers.ChatHandlers``): two models side by side (the original or any finished run each)
- ``compare`` (``compare.Compare``): two or more runs in one view
- ``bit_plan`` (``bit_plan.BitPlanView``): the watched job's bit plan by sensitivity
- ``divergence`` (``divergence_handlers.DivergenceHandlers``): where a run departs from its original, per token

``app.py`` lays the page out and wires these handlers to it; what they show is formatted by ``views``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .app_settings import AppSettings
from .bit_plan import BitPlanView
from .chat import ChatSession
from .chat_handlers import ChatHandlers
from .compare import Compare
from .divergence_handlers import DivergenceHandlers
from .downloads import Downloads
from .evaluation import Evaluation, TaskEvaluation
from .hub import HubPush
from .model_cache import ModelCache
from .quantize_form import QuantizeForm
from .queue import JobManager
from .run_models import RunModels
from .runs import Runs
from .services import Shared, make_manager
from .session import Pages
from .task import quantization_task
from .uploads import Uploads

__all__ = ["AppSettings", "Studio"]


class Studio:
    """The handler groups of one app, sharing its settings, job manager and model cache (``shared``).
    ``make_task`` builds a job's task (``Runs``), ``make_chat`` one chat side (``ChatHandlers``), ``hub_api`` the
    hub client (``HubPush``)."""

    def __init__(self, settings: AppSettings, manager: JobManager | None = None, cache: ModelCache | None = None,
                 make_task: Callable[..., Callable] = quantization_task,
                 make_chat: Callable[..., ChatSession] = ChatSession, hub_api: Callable[..., Any] | None = None,
                 janitor_interval_s: float = 60.0):
        self.shared = Shared(settings, manager or make_manager(settings), cache or ModelCache(max_items=4))
        self.models = RunModels(self.shared)
        self.downloads = Downloads(self.shared)
        self.manager.on_delete(self.downloads.run_deleted)
        self.manager.on_delete(self.models.run_deleted)
        self.quantize_form = QuantizeForm(self.shared)
        self.runs = Runs(self.shared, self.quantize_form, self.downloads, make_task)
        self.evaluation = Evaluation(self.shared, self.models, self.downloads)
        self.tasks = TaskEvaluation(self.shared, self.models)
        self.hub = HubPush(self.shared, hub_api)
        self.uploads = Uploads(self.shared, self.models)
        self.chat = ChatHandlers(self.shared, self.models, make_chat)
        self.divergence = DivergenceHandlers(self.shared, self.models)
        self.compare = Compare(self.shared)
        self.bit_plan = BitPlanView(self.shared)
        self.pages = Pages(self.shared, self._stop_page, janitor_interval_s)

    def _stop_page(self, session: str) -> None:
        """A page went away: its chats and its divergence comparison stop."""
        self.chat.stop_page(session)
        self.divergence.stop_page(session)

    @property
    def settings(self) -> AppSettings:
        return self.shared.settings

    @property
    def manager(self) -> JobManager:
        return self.shared.manager

    @property
    def cache(self) -> ModelCache:
        return self.shared.cache

    def owner(self, request) -> str:
        """Who the request acts for (``services.Identities.owner``)."""
        return self.shared.owner(request)

    def close(self) -> None:
        """Stop the janitor (the job manager keeps its jobs; ``manager.shutdown`` ends them)."""
        self.pages.close()

"""Pushing a finished run to the user's own Hugging Face repo, with the user's token (Sign in with Hugging Face
on Spaces, a pasted write token elsewhere; never the server's)."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gradio as gr

from ..storage.archive import allowed_file
from .card import CARD_NAME, write_model_card
from .estimate import hub_reachable
from .evaluation import refresh_card
from .services import Shared

HUB_REPO = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}$")


class HubPush:
    """``hub_api(token=)`` makes a ``huggingface_hub.HfApi`` (None: the real one); ``reachable()`` says whether
    the hub can be reached from here, as (bool, why not)."""

    def __init__(self, shared: Shared, hub_api: Callable[..., Any] | None = None,
                 reachable: Callable[[], tuple[bool, str]] = hub_reachable) -> None:
        self.shared = shared
        self.hub_api = hub_api
        self.reachable = reachable

    def status(self):
        """Whether pushing to the hub can work from this server: (note, push button)."""
        reachable, why = self.reachable()
        if not reachable:
            return (f"⚠️ Pushing is disabled: this server cannot reach the Hugging Face hub ({why}). Download the "
                    "zip instead.", gr.Button(interactive=False))
        return "", gr.Button(interactive=True)

    def push(self, job_id: str, repo_id: str, private: bool, token: str, request: gr.Request,
             oauth_token: gr.OAuthToken | None = None) -> tuple[str, str]:
        """Upload a finished run's checkpoint (with its model card) to the user's own hub repo, with the user's
        token (Sign in with Hugging Face on Spaces, a pasted write token elsewhere; never the server's)."""
        owner = self.shared.owner(request)
        manager = self.shared.manager
        try:
            snap = manager.get(job_id, owner, reports=False)
            if snap.status != "done" or not (snap.result or {}).get("checkpoint_dir"):
                raise ValueError(f"job {job_id or '(none)'} has no checkpoint to push (status: {snap.status})")
            repo_id = (repo_id or "").strip()
            if not HUB_REPO.match(repo_id):
                raise ValueError(f"repo must be 'your-name/repo-name' (letters, digits, '-', '_', '.'), got "
                                 f"{repo_id!r}")
            reachable, why = self.reachable()
            if not reachable:
                raise ValueError(f"cannot reach the Hugging Face hub ({why}); pushing is disabled, download the zip "
                                 "instead")
            secret = (oauth_token.token if oauth_token is not None else "") or (token or "").strip()
            if not secret:
                raise ValueError("sign in with Hugging Face (on Spaces) or paste a write token to push")
            snap = refresh_card(manager, snap, owner)
            files = self._upload(snap, repo_id, bool(private), secret)
            manager.set_extra(job_id, owner, "exported", True)
            manager.set_extra(job_id, owner, "pushed", repo_id)
        except ValueError as exc:
            raise self.shared.error(exc) from None
        return (f"Pushed {len(files)} files to [{repo_id}](https://huggingface.co/{repo_id})"
                f"{' (private)' if private else ''}.", self.shared.guard(owner))

    def _upload(self, snap, repo_id: str, private: bool, secret: str) -> list[str]:
        """Create the repo (if new) and upload the checkpoint's files; the names uploaded. The hub's refusal
        becomes a ValueError of one line, without the token."""
        ckpt = Path(snap.result["checkpoint_dir"])
        if snap.kind == "import" and not (ckpt / CARD_NAME).is_file():
            write_model_card(ckpt, snap.result.get("source_model"), snap.extras.get("eval"))
        api = self.hub_api(token=secret) if self.hub_api else _hf_api(secret)
        files = sorted(p.name for p in ckpt.iterdir() if p.is_file() and allowed_file(p.name))
        try:
            api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
            api.upload_folder(folder_path=str(ckpt), repo_id=repo_id, repo_type="model", allow_patterns=files,
                              commit_message=f"Upload {snap.title} (VPTQ Studio)")
        except Exception as exc:  # noqa: BLE001 - the hub client raises many kinds; one line for the user
            text = str(exc).replace(secret, "***").splitlines()[0][:300] if str(exc) else type(exc).__name__
            raise ValueError(f"the hub refused the push: {text}") from None
        return files


def _hf_api(token: str):
    from huggingface_hub import HfApi

    return HfApi(token=token)

"""Packed checkpoints coming in and going out through the app: uploads checked and limited before they become
runs, and the push to the user's own hub repo (a stand-in hub)."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import struct
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

gradio_client = pytest.importorskip("gradio_client")
from gradio_client import Client, handle_file  # noqa: E402
from gradio_client.exceptions import AppError  # noqa: E402
from studio_helpers import as_request, job_kwargs, make_tiny_checkpoint, serve_app  # noqa: E402

from vptq_core.storage.archive import pack_checkpoint  # noqa: E402
from vptq_core.studio import views  # noqa: E402

served = pytest.fixture(scope="module", name="served")(serve_app)
tiny_checkpoint = pytest.fixture(scope="module", name="tiny_checkpoint")(make_tiny_checkpoint)


def test_bad_archives_are_refused_with_the_reason(served, tmp_path):
    client = Client(served.url, verbose=False)
    bad = tmp_path / "bad.zip"
    with zipfile.ZipFile(bad, "w") as zf:
        zf.writestr("config.json", "{}")
        zf.writestr("../model.safetensors", b"x")
    with pytest.raises(AppError, match=r"cannot load bad.zip: entry '../model.safetensors': path traversal"):
        client.predict(handle_file(str(bad)), api_name="/upload")
    with zipfile.ZipFile(bad, "w") as zf:
        zf.writestr("config.json", "{}")
        zf.writestr("pytorch_model.bin", b"\x80\x04.")
    with pytest.raises(AppError, match=r"unexpected file 'pytorch_model.bin'"):
        client.predict(handle_file(str(bad)), api_name="/upload")
    assert served.studio.manager.jobs(client.session_hash) == []
    client.close()


def _safetensors_bytes(header: dict, data: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def test_uploads_are_limited_and_checked_before_they_become_runs(served, tiny_checkpoint, tmp_path, monkeypatch):
    client = Client(served.url, verbose=False)
    owner = served.studio.pages.attach(None, as_request(client))[0]
    jobs_dir = served.workdir / "jobs"
    monkeypatch.setattr(served.studio.uploads.files, "grace_s", 0.0)  # no other session uploads the same files

    def refused(path: Path, message: str) -> None:
        before = set(jobs_dir.iterdir())
        with pytest.raises(AppError, match=message):
            client.predict(handle_file(str(path)), api_name="/upload")
        # nothing written stays on disk (<=: a closed session's runs from an earlier test may go meanwhile)
        assert set(jobs_dir.iterdir()) <= before
        assert not any(p.name == path.name for p in served.studio.shared.serve_dir.rglob("*"))  # the upload is gone too

    # A zip bomb: a valid safetensors header, then 50 MB of zeros, deflated to ~50 kB.
    bomb = tmp_path / "bomb.zip"
    with zipfile.ZipFile(bomb, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("config.json", (tiny_checkpoint / "config.json").read_text())
        n = 50_000_000
        zf.writestr("model.safetensors", _safetensors_bytes(
            {"x": {"dtype": "U8", "shape": [n], "data_offsets": [0, n]}}, bytes(n)))
    assert bomb.stat().st_size < 1_000_000
    refused(bomb, r"cannot load bomb.zip: entry 'model.safetensors' unpacks to 50000\d+ bytes \(50.0 MB\) from \d+ "
                  r"compressed bytes, a ratio of \d+; at most 100 is allowed")
    # Deeply nested JSON: a reason, not a RecursionError.
    nested = tmp_path / "nested.zip"
    with zipfile.ZipFile(nested, "w") as zf:
        zf.writestr("config.json", "[" * 100_000 + "]" * 100_000)
        zf.writestr("model.safetensors", (tiny_checkpoint / "model.safetensors").read_bytes())
    refused(nested, r"cannot load nested.zip: config.json: JSON nested too deeply")

    # A checkpoint whose tensors do not match what its config implies is refused at upload, not at chat.
    good = pack_checkpoint(tiny_checkpoint, tmp_path / "good.zip")
    tensors = load_file(str(tiny_checkpoint / "model.safetensors"))
    tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"][:, :32].contiguous()
    wrong = tmp_path / "wrong-dir"
    shutil.copytree(tiny_checkpoint, wrong)
    save_file(tensors, str(wrong / "model.safetensors"), metadata={"format": "pt"})
    refused(pack_checkpoint(wrong, tmp_path / "wrong.zip"), r"cannot load wrong.zip: .*model.embed_tokens.weight")
    tensors = load_file(str(tiny_checkpoint / "model.safetensors"))
    name = next(k for k in tensors if k.endswith(".scales"))
    tensors[name] = tensors[name].to(torch.int32)
    save_file(tensors, str(wrong / "model.safetensors"), metadata={"format": "pt"})
    refused(pack_checkpoint(wrong, tmp_path / "dtype.zip"), rf"cannot load dtype.zip: .*{re.escape(name)}")
    assert served.studio.manager.jobs(owner) == []

    # The disk quotas: this browser's, then everyone's; the runs per browser.
    size = sum(p.stat().st_size for p in tiny_checkpoint.iterdir())
    settings = served.studio.settings
    monkeypatch.setattr(served.studio.shared, "settings", dataclasses.replace(settings, user_quota_bytes=size // 2))
    refused(good, rf"archive expands to more than {size // 2} bytes .*\(what is left of your "
                  rf"{re.escape(views.mb(size // 2))} disk quota\)")
    monkeypatch.setattr(served.studio.shared, "settings", dataclasses.replace(settings, total_quota_bytes=size // 2))
    refused(good, r"what is left of the server's .* disk quota")
    monkeypatch.setattr(served.studio.shared, "settings", settings)
    picked = client.predict(handle_file(str(good)), api_name="/upload")[0]["value"]
    assert [s.id for s in served.studio.manager.jobs(owner)] == [picked]
    monkeypatch.setattr(served.studio.manager, "max_runs_per_owner", 1)
    refused(good, r"you already have 1 runs kept or in progress \(limit 1 per browser\); delete one")
    with pytest.raises(AppError, match=r"limit 1 per browser"):
        client.predict(**job_kwargs(), api_name="/start")
    monkeypatch.setattr(served.studio.manager, "max_runs_per_owner", 6)
    used = served.studio.manager.disk_usage(owner)
    monkeypatch.setattr(served.studio.shared, "settings", dataclasses.replace(settings, user_quota_bytes=used + 1000))
    with pytest.raises(AppError, match=rf"this run needs about .* MB; your runs use {used / 1e6:.1f} MB of your "
                                       r"0.\d MB disk quota: delete a run"):
        client.predict(**job_kwargs(), api_name="/start")
    client.predict(picked, "", api_name="/delete_run")
    client.close()


def test_push_to_the_users_hub_repo(served, tiny_checkpoint, monkeypatch):
    client = Client(served.url, verbose=False)
    request = as_request(client)
    run = client.predict(handle_file(str(pack_checkpoint(tiny_checkpoint, tiny_checkpoint.parent / "h.zip"))),
                         api_name="/upload")[0]["value"]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    note, button = served.studio.hub.status()
    assert "Pushing is disabled" in note and "HF_HUB_OFFLINE is set" in note and button.interactive is False
    with pytest.raises(AppError, match=r"cannot reach the Hugging Face hub \(HF_HUB_OFFLINE is set\); pushing is "
                                       r"disabled, download the zip instead"):
        client.predict(run, "me/tiny-rtn", True, "hf_secret", api_name="/push")
    monkeypatch.setattr(served.studio.hub, "reachable", lambda: (True, ""))
    calls = []

    class FakeHub:
        def __init__(self, token):
            calls.append(("token", token))

        def create_repo(self, repo_id, private, exist_ok, repo_type):
            calls.append(("create", repo_id, private))

        def upload_folder(self, folder_path, repo_id, repo_type, allow_patterns, commit_message):
            calls.append(("upload", repo_id, sorted(allow_patterns)))
            if repo_id == "me/refused":
                raise RuntimeError("403 Forbidden: token hf_secret cannot write\nmore")

    monkeypatch.setattr(served.studio.hub, "hub_api", lambda token: FakeHub(token))
    with pytest.raises(AppError, match=r"repo must be 'your-name/repo-name'"):
        client.predict(run, "../etc", True, "hf_secret", api_name="/push")
    with pytest.raises(AppError, match=r"sign in with Hugging Face \(on Spaces\) or paste a write token"):
        client.predict(run, "me/tiny-rtn", True, "", api_name="/push")
    message, guard = served.studio.hub.push(run, "me/tiny-rtn", True, "hf_secret", request)
    assert message.startswith("Pushed 8 files to [me/tiny-rtn](https://huggingface.co/me/tiny-rtn) (private)")
    assert calls[:2] == [("token", "hf_secret"), ("create", "me/tiny-rtn", True)]
    assert "README.md" in calls[2][2] and "model.safetensors" in calls[2][2] and 'data-unexported="0"' in guard
    with pytest.raises(AppError, match=r"the hub refused the push: 403 Forbidden: token \*\*\* cannot write$"):
        client.predict(run, "me/refused", False, "hf_secret", api_name="/push")
    client.predict(run, "", api_name="/delete_run")
    client.close()

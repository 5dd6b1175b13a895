"""Limits that hold however many sessions a client opens: jobs per network address (read from X-Forwarded-For
only behind a trusted proxy), and Gradio's upload folder counted in the disk quota of all users and cleaned at
start and on a schedule."""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

gradio_client = pytest.importorskip("gradio_client")
from gradio_client import Client  # noqa: E402
from gradio_client.exceptions import AppError  # noqa: E402
from studio_helpers import GatedRuns, free_port, job_kwargs  # noqa: E402

import app as studio_app  # noqa: E402
from vptq_core.models import TINY  # noqa: E402
from vptq_core.studio import handlers  # noqa: E402
from vptq_core.studio.client_address import client_address  # noqa: E402
from vptq_core.studio.upload_folder import UploadFolder  # noqa: E402

HOUR = 3600.0


def _request(host: str, forwarded: str | None = None) -> SimpleNamespace:
    headers = {"X-Forwarded-For": forwarded} if forwarded is not None else {}
    return SimpleNamespace(client=SimpleNamespace(host=host), headers=headers, session_hash="s")


# Public addresses (private ones at the right end of X-Forwarded-For are taken for internal proxies).
A, B = "93.184.216.34", "151.101.1.69"


def test_the_client_address_believes_only_the_trusted_proxies():
    assert client_address(_request("10.0.0.1", A), proxy_hops=0) == "10.0.0.1"  # no proxy: the header is ignored
    assert client_address(_request("10.0.0.1", A), proxy_hops=1) == A
    # What the client wrote itself (left of what the proxy appended) is not believed.
    assert client_address(_request("10.0.0.1", f"1.2.3.4, 5.6.7.8 ,{A}"), proxy_hops=1) == A
    assert client_address(_request("10.0.0.1", f"1.2.3.4, {A}, {B}"), proxy_hops=2) == A
    # An internal hop the operator did not count is passed over, not taken for everyone's address.
    assert client_address(_request("10.0.0.1", f"1.2.3.4, {A}, 10.0.0.9, 127.0.0.1"), proxy_hops=1) == A
    assert client_address(_request("10.0.0.1", "10.0.0.9"), proxy_hops=1) == "10.0.0.1"
    assert client_address(_request("10.0.0.1"), proxy_hops=1) == "10.0.0.1"  # no header: the peer
    assert client_address(_request("10.0.0.1", A), proxy_hops=2) == "10.0.0.1"  # fewer entries than proxies
    # One IPv6 client holds a whole /64: its addresses count as one.
    assert client_address(_request("2001:db8:1:2::5"), 0) == client_address(_request("2001:db8:1:2:ffff::1"), 0)
    assert client_address(_request("2001:db8:1:2::5"), 0) != client_address(_request("2001:db8:1:3::5"), 0)
    assert client_address(_request("::ffff:192.0.2.1"), 0) == "192.0.2.1"
    assert client_address(None) is None and client_address(SimpleNamespace(client=None)) is None


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The app behind one trusted proxy, with its own Gradio upload folder."""
    with pytest.MonkeyPatch.context() as mp:
        cache = tmp_path_factory.mktemp("gradio-cache")
        mp.setenv("GRADIO_TEMP_DIR", str(cache))
        settings = studio_app.AppSettings(workdir=tmp_path_factory.mktemp("quotas"), default_model=TINY,
                                          proxy_hops=1)
        runs = GatedRuns()
        studio = handlers.Studio(settings, make_task=runs)
        demo = studio_app.build_app(settings, studio)
        port = free_port()
        demo.launch(prevent_thread_lock=True, server_port=port, quiet=True, **studio_app.launch_options(settings))
        yield SimpleNamespace(url=f"http://127.0.0.1:{port}/", studio=studio, runs=runs, cache=cache)
        runs.release_all()
        studio.manager.shutdown(timeout=30)
        demo.close()


def test_eight_sessions_from_one_address_get_its_limit_and_another_address_a_slot(served):
    settings = served.studio.settings
    assert (settings.max_jobs_per_user, settings.max_jobs_per_address) == (2, 4)
    sessions = [Client(served.url, verbose=False, headers={"X-Forwarded-For": A}) for _ in range(8)]
    started, refused = [], []
    for client in sessions:
        for _ in range(2):
            try:
                started.append(client.predict(**job_kwargs(), api_name="/start")[0])
            except AppError as exc:
                refused.append(str(exc))
    assert len(started) == 4 and len(refused) == 12
    assert all("4 jobs from your network address are queued or running (limit 4 per address, whatever the browser "
               "or session); wait for one to finish" in r for r in refused)
    # Writing another address in front of the one the proxy appends changes nothing.
    spoofing = Client(served.url, verbose=False, headers={"X-Forwarded-For": f"{B}, {A}"})
    with pytest.raises(AppError, match="jobs from your network address"):
        spoofing.predict(**job_kwargs(), api_name="/start")
    # Another address still gets a slot in the queue.
    other = Client(served.url, verbose=False, headers={"X-Forwarded-For": B})
    job = other.predict(**job_kwargs(), api_name="/start")[0]
    assert other.predict(job, api_name="/job_status")["status"] in ("queued", "running")
    # When one of the address's jobs ends, the address may queue one more.
    sessions[0].predict(started[1], api_name="/cancel")  # (a queued one: it leaves at once)
    assert sessions[5].predict(**job_kwargs(), api_name="/start")[0]
    with pytest.raises(AppError, match="limit 4 per address"):
        sessions[6].predict(**job_kwargs(), api_name="/start")
    for client in (*sessions, spoofing, other):
        client.close()


def test_files_sent_to_gradio_count_in_the_total_disk_quota(served):
    folder = served.studio.shared.upload_folder
    assert folder.folder == served.cache
    before = folder.usage()
    payload = os.urandom(300_000)
    response = httpx.post(f"{served.url}gradio_api/upload", files={"files": ("blob.bin", payload)}, timeout=30)
    assert response.status_code == 200
    stored = Path(response.json()[0])
    assert stored.is_relative_to(served.cache) and stored.read_bytes() == payload
    assert folder.usage() == before + len(payload)
    shared = served.studio.shared
    total = shared.manager.disk_usage() + folder.usage()
    settings = shared.settings
    try:
        shared.settings = type(settings)(**{**settings.__dict__, "total_quota_bytes": total + 1000})
        with pytest.raises(ValueError, match=r"the server's runs and uploads use [\d.]+ MB of [\d.]+ MB"):
            shared.check_disk("someone", 2000, "this run")
        shared.check_disk("someone", 500, "this run")
    finally:
        shared.settings = settings


def _file(folder: Path, name: str, size: int, age_s: float) -> Path:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * size)
    when = time.time() - age_s
    os.utime(path, (when, when))
    return path


def test_the_upload_folder_is_cleaned_at_start_and_on_schedule(tmp_path, monkeypatch):
    cache = tmp_path / "gradio-cache"
    monkeypatch.setenv("GRADIO_TEMP_DIR", str(cache))
    old = _file(cache, "aaa/old.zip", 1000, 2 * HOUR)  # left by an earlier process
    fresh = _file(cache, "bbb/fresh.zip", 700, 60)
    archive = _file(tmp_path / "work-elsewhere", "run.zip", 5000, 3 * HOUR)  # a run finished hours ago
    download = cache / "ccc" / "download.zip"
    download.parent.mkdir()
    os.link(archive, download)  # a fresh download copy of it: the run counts it already, and it is kept
    settings = studio_app.AppSettings(workdir=tmp_path / "work", default_model=TINY, upload_ttl_hours=1.0)
    studio = handlers.Studio(settings, janitor_interval_s=0.05)
    try:
        assert studio.shared.upload_folder.folder == cache
        assert not old.exists() and not old.parent.exists() and fresh.exists() and download.exists()
        assert studio.shared.upload_folder.usage() == 700
        when = time.time() - 2 * HOUR
        os.utime(fresh, (when, when))  # it grows old while the app runs: the janitor takes it
        deadline = time.monotonic() + 30
        while fresh.exists():
            assert time.monotonic() < deadline, "the janitor never cleaned the upload folder"
            time.sleep(0.05)
    finally:
        studio.close()


def test_an_upload_folder_over_its_size_loses_its_oldest_files_first(tmp_path):
    folder = UploadFolder(tmp_path, max_age_s=HOUR, max_bytes=2500, min_age_s=300)
    files = [_file(tmp_path, f"d{i}/f{i}", 1000, age) for i, age in enumerate((1800, 1200, 900, 60))]
    assert folder.usage() == 4000
    assert folder.clean() == 2  # the two oldest go; then it fits
    assert [f.exists() for f in files] == [False, False, True, True] and folder.usage() == 2000
    young = UploadFolder(tmp_path, max_age_s=HOUR, max_bytes=10, min_age_s=300)
    assert young.clean() == 1 and files[3].exists()  # a file still being handled is never taken

"""The app under several concurrent sessions: does its server keep answering?

``python app.py --tiny`` is started in a subprocess on a fresh work directory; ``--sessions`` API clients
(``gradio_client``, one session each) then each run the whole flow at once: start a 4-bit RTN job on the tiny
model and poll it to the end, evaluate it, download its archive, upload that archive back as a new run, chat with
it ``--chats`` times, evaluate the upload. Meanwhile a probe asks the server for ``/gradio_api/app_id`` every
0.1 s, the request a page whose connection broke repeats until it gets an answer: its latency is how long a
page would wait on the server's event loop. The table gives the events each session got through, the refusals
(the per-browser and per-address job limits refuse some starts when many sessions share one address: they are
counted, not failures) and failures, and the probe's latency.

    python bench/app_load.py                  # 6 sessions, 3 chats each
    python bench/app_load.py --sessions 1 --chats 1
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TINY = "tiny-random-llama"
JOB = dict(model=TINY, custom_model="", method="rtn", vector_len=4, num_centroids=16, num_res_centroids=0,
           outlier_percent=0, group_num=1, enable_norm=False, enable_perm=True, kmeans_iters=2, finetune_iters=0,
           bits_budget=0.0, layer_bits_cap=0.0, allocation="cap", distill_iters=0, distill_data="calibration",
           bits=4, group_size=32, act_order=True, rank=0, iters=5, calib_file=None, calib_samples=8, calib_seqlen=128,
           seed=0)  # with the form's activation and calibration choices (``_job``)


def _job() -> dict:
    from vptq_core.studio import form

    return {**JOB, "activations": form.WEIGHT_ONLY, "calib_source": form.WIKI_SOURCE}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=6, help="concurrent API sessions")
    parser.add_argument("--chats", type=int, default=3, help="chat messages per session")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds for the whole flow")
    return parser.parse_args(argv)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_app(workdir: Path, log: Path) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    env = dict(os.environ, GRADIO_SERVER_PORT=str(port), GRADIO_SERVER_NAME="127.0.0.1",
               GRADIO_ANALYTICS_ENABLED="False")
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "app.py", "--tiny", "--workdir", str(workdir)], cwd=ROOT, env=env,
                                stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/"
    deadline = time.monotonic() + 300
    while True:
        try:
            urllib.request.urlopen(url, timeout=2).close()
            return proc, url
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise SystemExit(f"the app did not start:\n{log.read_text()[-2000:]}") from None
            time.sleep(0.5)


class Probe(threading.Thread):
    """Asks ``/gradio_api/app_id`` every 0.1 s; keeps (latency, answered) per request."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.samples, self.stop = url + "gradio_api/app_id", [], threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            t = time.monotonic()
            try:
                urllib.request.urlopen(self.url, timeout=60).close()
                ok = True
            except OSError:
                ok = False
            self.samples.append((time.monotonic() - t, ok))
            self.stop.wait(0.1)


def session(url: str, chats: int, out: dict) -> None:
    """One client's whole flow; ``out`` gets the events it completed, its refusals and its failures."""
    from gradio_client import Client, handle_file
    from gradio_client.exceptions import AppError

    out.update(events=0, refused=0, failed=[])
    client = Client(url, verbose=False)

    def call(*args, api_name):
        result = client.predict(*args, api_name=api_name)
        out["events"] += 1
        return result

    try:
        job = client.predict(**_job(), api_name="/start")[0]
        out["events"] += 1
    except AppError as exc:
        out["refused"] += 1 if "limit" in str(exc) else 0
        if "limit" not in str(exc):
            out["failed"].append(f"start: {exc}")
        return
    try:
        while call(job, api_name="/job_status")["status"] in ("queued", "running"):
            time.sleep(1)
        call(job, 2, 64, api_name="/evaluate")
        archive = call(job, api_name="/download")
        run = call(handle_file(archive), api_name="/upload")[0]["value"]
        for i in range(chats):
            call(f"Hello {i}", [], [], run, 0.0, 1.0, 32, api_name="/chat")
        call(run, 2, 64, api_name="/evaluate_run")
    except Exception as exc:  # noqa: BLE001 - a failure is what this measures
        out["failed"].append(f"{type(exc).__name__}: {str(exc)[:200]}")
    finally:
        client.close()


def main(argv=None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="app_load_") as tmp:
        proc, url = _start_app(Path(tmp) / "work", Path(tmp) / "app.log")
        probe = Probe(url)
        probe.start()
        t0 = time.monotonic()
        results = [{} for _ in range(args.sessions)]
        threads = [threading.Thread(target=session, args=(url, args.chats, r), daemon=True) for r in results]
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(args.timeout - (time.monotonic() - t0), 1))
        wall = time.monotonic() - t0
        probe.stop.set()
        probe.join(60)
        proc.terminate()
        proc.wait(30)
    hung = sum(t.is_alive() for t in threads)
    latencies = sorted(s for s, _ok in probe.samples)
    unanswered = sum(1 for _s, ok in probe.samples if not ok)
    print(f"machine: {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} CPUs; app: python app.py "
          f"--tiny; {args.sessions} sessions at once, each: RTN 4-bit job, evaluate, download, upload, "
          f"{args.chats} chats, evaluate the upload; probe: GET /gradio_api/app_id every 0.1 s; {wall:.0f} s")
    print("\n| session | events | refused by a limit | failures |")
    print("|---|---|---|---|")
    for i, r in enumerate(results):
        print(f"| {i} | {r.get('events', 0)} | {r.get('refused', 0)} | {'; '.join(r.get('failed', [])) or '-'} |")
    if latencies:
        p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
        print("\n| probes | unanswered | median s | p99 s | max s | sessions still running |")
        print("|---|---|---|---|---|---|")
        print(f"| {len(latencies)} | {unanswered} | {statistics.median(latencies):.3f} | {p99:.3f} | "
              f"{latencies[-1]:.3f} | {hung} |")


if __name__ == "__main__":
    main()

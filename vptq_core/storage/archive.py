"""Checkpoint archives: zip a checkpoint directory for download, and validate + extract an uploaded one.

An archive holds one checkpoint directory, either at the top of the zip or inside a single top-level folder.
Only the files a checkpoint needs are accepted (``config.json``, ``*.safetensors``, tokenizer files,
``quant_report.json``, ``generation_config.json``, ``chat_template.jinja``, the model card ``README.md``), each
checked for what it claims to be: JSON files parse as JSON objects, safetensors files have a consistent header,
text files are UTF-8. Nothing is unpickled. Entries with absolute paths, ``..``, backslashes, symlinks,
encryption, duplicates, or sizes beyond the limits are rejected with an ``ArchiveError`` (a ``ValueError``)
that names the entry, the limit and the value.

Size limits (``inspect_archive`` on the declared sizes, ``extract_checkpoint`` again on the bytes actually
written, since a zip's headers may lie): ``max_bytes`` unpacked in total, ``max_entry_bytes`` per file, at most
``max_ratio`` unpacked bytes per compressed byte per entry and for the whole archive against its real size on
disk (entries and archives unpacking to less than ``RATIO_FLOOR`` bytes are exempt: small JSON compresses
well), and ``max_files`` entries.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import stat
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

JSON_FILES = frozenset({
    "config.json", "generation_config.json", "quant_report.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "added_tokens.json", "vocab.json", "model.safetensors.index.json",
})
TEXT_FILES = frozenset({"chat_template.jinja", "merges.txt", "README.md"})
REQUIRED_FILES = ("config.json",)
SAFETENSORS_SUFFIX = ".safetensors"

DEFAULT_MAX_BYTES = 2_000_000_000  # uncompressed total of all entries
DEFAULT_MAX_ENTRY_BYTES = 2_000_000_000  # uncompressed size of one entry
DEFAULT_MAX_FILES = 64
DEFAULT_MAX_RATIO = 100.0  # uncompressed / compressed bytes (stored safetensors: 1; tokenizer JSON: 3-5)
RATIO_FLOOR = 1_000_000  # below this many unpacked bytes the ratio is not checked
_MAX_JSON_BYTES = 64_000_000
_MAX_SAFETENSORS_HEADER = 100_000_000
_COPY_CHUNK = 1 << 20
_SAFETENSORS_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4,
    "U32": 4, "F32": 4, "F64": 8, "I64": 8, "U64": 8,
}


class ArchiveError(ValueError):
    """An archive (or one of its entries) is not an acceptable checkpoint archive."""


@dataclass(frozen=True)
class ArchiveEntry:
    name: str  # file name inside the checkpoint directory, e.g. "model.safetensors"
    member: str  # full name inside the zip, e.g. "run-1a2b/model.safetensors"
    size: int  # uncompressed bytes declared by the zip


def allowed_file(name: str) -> bool:
    """Whether a checkpoint directory may hold a file called ``name`` (a bare file name)."""
    return name in JSON_FILES or name in TEXT_FILES or (
        name.endswith(SAFETENSORS_SUFFIX) and len(name) > len(SAFETENSORS_SUFFIX)
    )


def pack_checkpoint(src_dir: str | os.PathLike, zip_path: str | os.PathLike, folder: str | None = None) -> Path:
    """Zip the checkpoint files of ``src_dir`` into ``zip_path`` (written atomically) and return its path.

    Files go under ``folder/`` (default: the zip's stem) so extracting gives one directory. Only regular files
    that ``allowed_file`` accepts are packed; safetensors are stored (they barely compress), the rest deflated.
    """
    src = Path(src_dir)
    if not src.is_dir():
        raise ValueError(f"src_dir {str(src)!r} is not a directory")
    out = Path(zip_path)
    if out.suffix != ".zip":
        raise ValueError(f"zip_path must end with .zip, got {str(out)!r}")
    folder = out.stem if folder is None else folder
    _check_part(folder, "folder")
    files = sorted(p for p in src.iterdir() if p.is_file() and not p.is_symlink() and allowed_file(p.name))
    missing = [name for name in REQUIRED_FILES if not (src / name).is_file()]
    if missing or not any(p.name.endswith(SAFETENSORS_SUFFIX) for p in files):
        raise ValueError(f"{src} is not a checkpoint directory: it needs {', '.join(REQUIRED_FILES)} and a "
                         f"*.safetensors file")
    tmp = out.with_name(out.name + ".tmp")
    with zipfile.ZipFile(tmp, "w") as zf:
        for path in files:
            method = zipfile.ZIP_STORED if path.name.endswith(SAFETENSORS_SUFFIX) else zipfile.ZIP_DEFLATED
            zf.write(path, f"{folder}/{path.name}", compress_type=method)
    os.replace(tmp, out)
    return out


def _check_part(part: str, what: str) -> None:
    if not part or part in (".", "..") or "/" in part or "\\" in part or "\x00" in part or ":" in part:
        raise ArchiveError(f"{what} {part!r} is not a plain file or folder name")


def _size(n: int) -> str:
    return f"{n} bytes ({n / 1e6:.3f} MB)" if n < 100_000 else f"{n} bytes ({n / 1e6:.1f} MB)"


def _ratio_budget(compressed: int, max_ratio: float) -> float:
    """Unpacked bytes allowed for ``compressed`` bytes at ``max_ratio`` (at least ``RATIO_FLOOR``)."""
    return max(max_ratio * compressed, RATIO_FLOOR)


def _check_limits(max_bytes: int, max_files: int, max_entry_bytes: int, max_ratio: float) -> None:
    for name, value in (("max_bytes", max_bytes), ("max_files", max_files), ("max_entry_bytes", max_entry_bytes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    if not isinstance(max_ratio, (int, float)) or isinstance(max_ratio, bool) or not max_ratio >= 1:
        raise ValueError(f"max_ratio must be a number >= 1, got {max_ratio!r}")


def inspect_archive(
    zip_path: str | os.PathLike, max_bytes: int = DEFAULT_MAX_BYTES, max_files: int = DEFAULT_MAX_FILES,
    max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES, max_ratio: float = DEFAULT_MAX_RATIO,
    total_label: str = "the limit",
) -> list[ArchiveEntry]:
    """Check an archive's listing (no data read yet) and return the checkpoint files it holds.

    Raises ``ArchiveError`` for: not a zip, too many entries, an unsafe or unexpected entry name, symlinks,
    encrypted entries, duplicates, a missing ``config.json`` or safetensors file, an entry declaring more than
    ``max_entry_bytes`` or a compression ratio above ``max_ratio``, or more than ``max_bytes`` uncompressed in
    total (``total_label`` says what that limit is, e.g. "your disk quota") or more than ``max_ratio`` times
    the archive's size.
    """
    _check_limits(max_bytes, max_files, max_entry_bytes, max_ratio)
    path = Path(zip_path)
    if not path.is_file():
        raise ArchiveError(f"archive {str(path)!r} does not exist")
    try:
        zf = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as exc:
        raise ArchiveError(f"{path.name} is not a zip archive ({exc})") from None
    with zf:
        infos = zf.infolist()
    if len(infos) > max_files:
        raise ArchiveError(f"archive has {len(infos)} entries; at most {max_files} are allowed")
    entries: list[ArchiveEntry] = []
    folders: set[str] = set()
    total = 0
    for info in infos:
        member = info.filename
        if "\\" in member or "\x00" in member:
            raise ArchiveError(f"entry {member!r}: backslashes and NUL bytes are not allowed in names")
        if member.startswith("/") or (len(member) > 1 and member[1] == ":"):
            raise ArchiveError(f"entry {member!r}: absolute paths are not allowed")
        parts = PurePosixPath(member).parts
        if any(p in ("..", ".") for p in parts) or "//" in member:
            raise ArchiveError(f"entry {member!r}: path traversal ('..') is not allowed")
        mode = info.external_attr >> 16
        if stat.S_ISLNK(mode):
            raise ArchiveError(f"entry {member!r} is a symbolic link; links are not allowed")
        if info.flag_bits & 0x1:
            raise ArchiveError(f"entry {member!r} is encrypted; encrypted archives are not supported")
        if info.is_dir():
            if len(parts) != 1:
                raise ArchiveError(f"entry {member!r}: nested folders are not allowed")
            folders.add(parts[0])
            continue
        if stat.S_IFMT(mode) not in (0, stat.S_IFREG):
            raise ArchiveError(f"entry {member!r} is not a regular file")
        if len(parts) > 2:
            raise ArchiveError(f"entry {member!r}: nested folders are not allowed (one top-level folder at most)")
        if len(parts) == 2:
            folders.add(parts[0])
        name = parts[-1]
        if not allowed_file(name):
            raise ArchiveError(
                f"entry {member!r}: unexpected file {name!r}; allowed: config.json, *.safetensors, tokenizer "
                f"files ({', '.join(sorted((JSON_FILES | TEXT_FILES) - {'config.json'}))})"
            )
        if info.file_size < 0:
            raise ArchiveError(f"entry {member!r} declares a negative size")
        if info.file_size > max_entry_bytes:
            raise ArchiveError(f"entry {member!r} unpacks to {_size(info.file_size)}; at most "
                               f"{_size(max_entry_bytes)} per file are allowed")
        if info.file_size > _ratio_budget(info.compress_size, max_ratio):
            raise ArchiveError(f"entry {member!r} unpacks to {_size(info.file_size)} from {info.compress_size} "
                               f"compressed bytes, a ratio of {info.file_size / max(info.compress_size, 1):.0f}; "
                               f"at most {max_ratio:g} is allowed")
        total += info.file_size
        if total > max_bytes:
            raise ArchiveError(f"archive expands to more than {_size(max_bytes)} ({total_label}); entry "
                               f"{member!r} crosses it")
        entries.append(ArchiveEntry(name=name, member=member, size=info.file_size))
    if len(folders) > 1 or (folders and any(len(PurePosixPath(e.member).parts) == 1 for e in entries)):
        raise ArchiveError(f"archive must hold one checkpoint: files at the top or in one folder, got folders "
                           f"{sorted(folders)}")
    names = [e.name for e in entries]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ArchiveError(f"archive holds {duplicates} more than once")
    missing = [n for n in REQUIRED_FILES if n not in names]
    if missing:
        raise ArchiveError(f"archive has no {', '.join(missing)}; it is not a checkpoint")
    if not any(n.endswith(SAFETENSORS_SUFFIX) for n in names):
        raise ArchiveError("archive has no *.safetensors weights file; it is not a checkpoint")
    archive_bytes = path.stat().st_size
    if total > _ratio_budget(archive_bytes, max_ratio):
        raise ArchiveError(f"archive of {_size(archive_bytes)} declares {_size(total)} unpacked, a ratio of "
                           f"{total / max(archive_bytes, 1):.0f}; at most {max_ratio:g} is allowed")
    return entries


def extract_checkpoint(
    zip_path: str | os.PathLike, dest_dir: str | os.PathLike, max_bytes: int = DEFAULT_MAX_BYTES,
    max_files: int = DEFAULT_MAX_FILES, max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES,
    max_ratio: float = DEFAULT_MAX_RATIO, total_label: str = "the limit",
) -> Path:
    """Validate ``zip_path`` and extract its checkpoint files flat into ``dest_dir`` (created; must be new or
    empty). The limits (see ``inspect_archive``) are enforced again on the bytes written, since a zip may lie
    about its sizes: an entry may not write more than it declared, than ``max_entry_bytes`` or than
    ``max_ratio`` times its compressed size, and all entries together no more than ``max_bytes`` or
    ``max_ratio`` times the archive's size. Then every file's content is checked. On any error nothing is
    left in ``dest_dir`` and ``ArchiveError`` names the entry, the limit and the value."""
    entries = inspect_archive(zip_path, max_bytes=max_bytes, max_files=max_files, max_entry_bytes=max_entry_bytes,
                              max_ratio=max_ratio, total_label=total_label)
    dest = Path(dest_dir)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise ValueError(f"dest_dir {str(dest)!r} must not exist or be an empty directory")
    created = not dest.exists()
    dest.mkdir(parents=True, exist_ok=True)
    total_budget = min(max_bytes, _ratio_budget(Path(zip_path).stat().st_size, max_ratio))
    try:
        written = 0
        with zipfile.ZipFile(zip_path) as zf:
            for entry in entries:
                info = zf.getinfo(entry.member)
                entry_budget = min(entry.size, max_entry_bytes, _ratio_budget(info.compress_size, max_ratio))
                target = dest / entry.name
                with zf.open(entry.member) as src, open(target, "xb") as dst:
                    count = 0
                    while chunk := src.read(_COPY_CHUNK):
                        count += len(chunk)
                        written += len(chunk)
                        if count > entry_budget:
                            raise ArchiveError(
                                f"entry {entry.member!r} unpacks to more than it may: it declared {entry.size} bytes; "
                                f"limits {_size(max_entry_bytes)} per file and a compression ratio of "
                                f"{max_ratio:g} ({info.compress_size} compressed bytes)")
                        if written > total_budget:
                            raise ArchiveError(
                                f"archive unpacks to more than {_size(int(total_budget))} (entry {entry.member!r} "
                                f"crosses it): limits {_size(max_bytes)} ({total_label}) and a compression ratio "
                                f"of {max_ratio:g}")
                        dst.write(chunk)
        for entry in entries:
            check_file(dest / entry.name)
    except zipfile.BadZipFile as exc:
        _remove(dest, created)
        raise ArchiveError(f"damaged archive: {exc}") from None
    except BaseException:
        _remove(dest, created)
        raise
    return dest


def _remove(dest: Path, created: bool) -> None:
    """Undo an extraction: the directory if this call made it, else only what it wrote into it."""
    if created:
        shutil.rmtree(dest, ignore_errors=True)
        return
    for child in dest.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)


def check_file(path: str | os.PathLike) -> None:
    """Check that one extracted checkpoint file is what its name says (JSON object, safetensors, UTF-8)."""
    path = Path(path)
    name = path.name
    if name in JSON_FILES:
        if path.stat().st_size > _MAX_JSON_BYTES:
            raise ArchiveError(f"{name}: larger than {_size(_MAX_JSON_BYTES)}")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ArchiveError(f"{name}: not valid JSON ({exc})") from None
        except RecursionError:
            raise ArchiveError(f"{name}: JSON nested too deeply to be a checkpoint file") from None
        if not isinstance(data, dict):
            raise ArchiveError(f"{name}: expected a JSON object, got {type(data).__name__}")
    elif name in TEXT_FILES:
        try:
            path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ArchiveError(f"{name}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    elif name.endswith(SAFETENSORS_SUFFIX):
        check_safetensors(path)
    else:
        raise ArchiveError(f"{name}: unexpected file")


def check_safetensors(path: str | os.PathLike) -> None:
    """Header of a safetensors file: 8-byte little-endian length, a JSON object of tensors whose dtypes are
    known and whose byte ranges tile the data section exactly."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ArchiveError(f"{path.name}: not a safetensors file (shorter than 8 bytes)")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > min(_MAX_SAFETENSORS_HEADER, size - 8):
            raise ArchiveError(f"{path.name}: not a safetensors file (header length {header_len} exceeds the file)")
        raw = f.read(header_len)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ArchiveError(f"{path.name}: not a safetensors file (header is not JSON: {exc})") from None
    except RecursionError:
        raise ArchiveError(f"{path.name}: not a safetensors file (header JSON nested too deeply)") from None
    if not isinstance(header, dict):
        raise ArchiveError(f"{path.name}: not a safetensors file (header is not a JSON object)")
    data_len = size - 8 - header_len
    spans = []
    for key, info in header.items():
        if key == "__metadata__":
            continue
        if not isinstance(info, dict) or info.get("dtype") not in _SAFETENSORS_DTYPE_BYTES:
            raise ArchiveError(f"{path.name}: tensor {key!r} has no valid dtype")
        offsets, shape = info.get("data_offsets"), info.get("shape")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets)
                or not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape)):
            raise ArchiveError(f"{path.name}: tensor {key!r} has malformed shape or data_offsets")
        begin, end = offsets
        if not 0 <= begin <= end <= data_len:
            raise ArchiveError(f"{path.name}: tensor {key!r} data_offsets {offsets} fall outside the file")
        if math.prod(shape) * _SAFETENSORS_DTYPE_BYTES[info["dtype"]] != end - begin:
            raise ArchiveError(f"{path.name}: tensor {key!r} of shape {shape} does not fill data_offsets {offsets}")
        spans.append((begin, end))
    spans.sort()
    cursor = 0
    for begin, end in spans:
        if begin != cursor:
            raise ArchiveError(f"{path.name}: tensor data regions overlap or leave gaps")
        cursor = end
    if cursor != data_len:
        raise ArchiveError(f"{path.name}: tensor data ends at byte {cursor}, the file holds {data_len}")

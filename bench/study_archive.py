"""A study's run folders packed into one archive, written the same way every time and read in
place: studies/<name>.tar.xz, <name> the last part of the study's folder (its --out).

    python bench/study.py --pack --out docs/study/crn16    # -> studies/crn16.tar.xz
    tar -xJf studies/crn16.tar.xz                          # the folders back, where they were

A study is a thousand small files (per run: study_run.json, train.log, the trainer's
metrics.jsonl, summary.json and config.yaml); packed it is one file, a tenth of their size (xz
over one tar stream, where the runs' configs and logs repeat), and the report's folder keeps only
the report. Members keep the paths the runs had (<out>/runs/<arm>-s<seed>/...), so the report
names a packed run exactly as it named the folder, and extracting the archive from the folder the
study ran in puts every file back. The bytes depend on the files alone: members sorted by name,
mtime 0, owner root, mode 0644, no directory entries, so packing the same runs again gives the
same archive and git stores no change.

It does not delete the folders it packed (the command prints how), pack what the report does not
read and a resume would (checkpoints/, adapter/, plots/, the claim marker), or read anything but
its own format: a .tar.xz that holds one study's folder.
"""

from __future__ import annotations

import io
import lzma
import os
import tarfile
from pathlib import Path

SKIPPED = ("checkpoints", "adapter", "plots", ".claimed")  # parts of a path never packed


def archive_of(out: Path, packed: Path) -> Path:
    """Where the runs of the study at `out` are packed: <packed>/<out's last part>.tar.xz."""
    name = Path(os.path.normpath(out)).name
    if not name or name == "..":
        raise SystemExit(f"--out {out}: name the study's folder itself, e.g. --out docs/study")
    return packed / f"{name}.tar.xz"


def read_members(path: Path) -> dict[str, bytes]:
    """Every file in the archive: {its path: its bytes}."""
    with tarfile.open(path, "r:xz") as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def packed_members(out: Path, packed: Path | None) -> dict[str, bytes]:
    """The packed files of the study at `out` ({} when it has no archive). An archive of that
    name that holds another folder's study (two studies in folders of one name) is not this
    one's: {} too, and packing refuses to overwrite it."""
    path = None if packed is None else archive_of(out, packed)
    if path is None or not path.is_file():
        return {}
    members = read_members(path)
    root = Path(out).as_posix() + "/"
    return members if all(name.startswith(root) for name in members) else {}


def holder(path: Path) -> str:
    """The study folder an archive holds (<folder>/<runs|sweep>/<run>/study_run.json)."""
    metas = sorted(n for n in read_members(path) if n.endswith("/study_run.json"))
    return str(Path(metas[0]).parents[2]) if metas and metas[0].count("/") >= 3 else "no study"


def folder_files(run_dir: Path) -> dict[str, bytes]:
    """A run folder's files on disk, {path: bytes}, without what is never packed (SKIPPED)."""
    files = {}
    for path in sorted(run_dir.rglob("*")):
        rel = path.relative_to(run_dir)
        if path.is_file() and not set(rel.parts) & set(SKIPPED):
            files[path.as_posix()] = path.read_bytes()
    return files


def write_archive(path: Path, files: dict[str, bytes]) -> None:
    """The archive of `files`, deterministic: sorted members with fixed metadata, xz at its
    default preset (no timestamps of its own); written beside and moved into place."""
    stream = io.BytesIO()
    with tarfile.open(fileobj=stream, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(files):
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(files[name]), 0, 0o644
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            tar.addfile(info, io.BytesIO(files[name]))
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_bytes(lzma.compress(stream.getvalue(), format=lzma.FORMAT_XZ))
    os.replace(partial, path)


def pack(out: Path, packed: Path) -> tuple[Path, list[Path], int]:
    """Pack the run folders on disk under `out` (<out>/<runs|sweep>/<run>/study_run.json) into
    the study's archive, with the runs it already held: a folder on disk replaces the packed
    run of its name whole (a run rerun or resumed since), the others stay. -> (the archive,
    the run folders packed from disk, the number of runs in it)."""
    path = archive_of(out, packed)
    runs = sorted(meta.parent for meta in out.glob("*/*/study_run.json"))
    if not runs:
        raise SystemExit(f"--pack: no run folders under {out} (<out>/runs/<arm>-s<seed>)")
    members = packed_members(out, packed)
    if path.is_file() and not members:
        raise SystemExit(
            f"--pack: {path} holds the runs of {holder(path)}, not of {out}: give --packed "
            "another folder, or run from the folder the study ran in"
        )
    on_disk = {run.as_posix() + "/" for run in runs}
    files = {n: b for n, b in members.items() if not n.startswith(tuple(on_disk))}
    for run in runs:
        files.update(folder_files(run))
    write_archive(path, files)
    count = len({n.rsplit("/", 1)[0] for n in files if n.endswith("/study_run.json")})
    return path, runs, count

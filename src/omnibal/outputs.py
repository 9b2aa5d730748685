"""Output paths: checked before any work is done, written atomically.

Every command checks each output path it was given *before* it starts (``check_file``, ``check_dir``): a
path that is a folder where a file is wanted, a file where a folder is wanted, under a file, or in a folder
that cannot be written is an :class:`~omnibal.errors.InputError` naming the argument, raised before any
other output has been written. Missing parent folders are created.

Files are then written atomically (``write_bytes``, ``write_text``, ``atomic_path``): to a temporary name
in the same folder, flushed and fsynced, given the mode a plain ``open()`` would give (``0o666`` minus the
umask, or the mode of the file it replaces), and renamed over the final name. A process killed mid-write
leaves the previous file intact, never a truncated one.

A set of files that belong together (a plan: plan.json, report, exports, figures) is written into a
temporary folder beside its final one and swapped in whole (``staged_dir``): an interrupted run leaves the
previous set untouched, and no file of an earlier run survives beside the new ones. ``check_replaceable_dir``
refuses, before any work, a folder that holds anything else, so the swap never removes a file the command
did not write.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fnmatch
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterable, Iterator

from omnibal.errors import InputError


def _nearest_existing(path: Path, flag: str, target: Path) -> Path:
    p = path
    while not p.exists() and p != p.parent:
        _check_link(p, flag, target)
        p = p.parent
    return p


def _check_link(p: Path, flag: str, target: Path) -> None:
    """A name that is there but leads nowhere: a symbolic link to a missing path, or a loop of links."""
    if os.path.islink(p):
        try:
            os.stat(p)
        except OSError as exc:
            what = "a loop of symbolic links" if exc.errno == errno.ELOOP else \
                f"a symbolic link to a missing path ({os.readlink(p)})"
            raise InputError(f"{p} is {what}: cannot write {target}", source=str(target), field=flag) from None


def _probe(folder: Path, target: Path, flag: str) -> None:
    """Create and remove a file in ``folder``: what the write will do, tried now. Permission bits say nothing
    to root and nothing about special file systems (``/proc``, ``/sys``) or one mounted read-only."""
    try:
        fd, name = tempfile.mkstemp(dir=folder, prefix=".omnibal-probe.")
    except OSError as exc:
        raise InputError(f"cannot write into {folder}: {exc.strerror or exc}", source=str(target),
                         field=flag) from None
    os.close(fd)
    os.unlink(name)


def _check_parent(path: Path, flag: str) -> None:
    ancestor = _nearest_existing(path.parent, flag, path)
    if not ancestor.is_dir():
        raise InputError(f"{ancestor} is a file, not a folder: cannot write {path}", source=str(path), field=flag)
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise InputError(f"cannot write into {ancestor} (permission denied)", source=str(path), field=flag)
    _probe(ancestor, path, flag)


def check_file(path: str | os.PathLike | None, flag: str) -> Path | None:
    """Check that ``path`` can be written as a file (see the module docstring); None passes through."""
    if path is None:
        return None
    p = Path(path)
    if str(path) == "" or p.is_dir():
        raise InputError("is a folder, not a file name" if str(path) else "empty path", source=str(path), field=flag)
    if not p.exists():
        _check_link(p, flag, p)
    if p.exists() and not p.is_file():
        raise InputError("exists and is not a regular file", source=str(path), field=flag)
    if p.exists() and not os.access(p, os.W_OK):
        raise InputError("exists and cannot be written (permission denied)", source=str(path), field=flag)
    _check_parent(p, flag)
    return p


IMAGE_FORMATS = ("png", "pdf", "svg", "jpg", "jpeg")
"""Plot formats (by the file's extension)."""


def check_image(path: str | os.PathLike | None, flag: str) -> Path | None:
    """:func:`check_file` for a plot, whose extension must name one of ``IMAGE_FORMATS``."""
    p = check_file(path, flag)
    if p is not None and image_format(p) not in IMAGE_FORMATS:
        raise InputError(f"a plot is written as one of {', '.join(IMAGE_FORMATS)} (by the extension)",
                         source=str(path), field=flag)
    return p


def image_format(path: str | os.PathLike) -> str:
    return Path(path).suffix.lstrip(".").lower()


def check_dir(path: str | os.PathLike | None, flag: str) -> Path | None:
    """Check that ``path`` is (or can be created as) a folder to write into; None passes through."""
    if path is None:
        return None
    p = Path(path)
    if str(path) == "":
        raise InputError("empty path", source=str(path), field=flag)
    if p.exists():
        if not p.is_dir():
            raise InputError("exists and is not a folder", source=str(path), field=flag)
        if not os.access(p, os.W_OK | os.X_OK):
            raise InputError("cannot write into this folder (permission denied)", source=str(path), field=flag)
        _probe(p, p, flag)
        return p
    _check_link(p, flag, p)
    _check_parent(p, flag)
    return p


def _umask() -> int:
    try:  # Linux >= 4.7 reports it without changing it (os.umask would, for a moment, for every thread)
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path beside ``path`` to write to (same suffix, so writers that go by the extension work);
    on a clean exit it is fsynced, given the final mode and renamed to ``path``; on an error it is removed. An
    ``OSError`` that names no file (a full disk, a quota: ``write`` knows no path) is raised naming ``path``."""
    final = Path(path)
    with naming_path(final):
        final.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(dir=final.parent, prefix=f".{final.name}.", suffix=f".tmp{final.suffix}")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        with naming_path(final):
            yield tmp
            _commit(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def naming_path(final: str | os.PathLike) -> Iterator[None]:
    """Re-raise an ``OSError`` without a file name (``write`` on a full disk or over a quota knows no path) as
    one naming ``final``, the file being written."""
    try:
        yield
    except OSError as exc:
        if exc.filename is not None or exc.errno is None:
            raise
        raise OSError(exc.errno, exc.strerror or str(exc), str(final)) from exc


def _commit(tmp: Path, final: Path) -> None:
    """fsync ``tmp``, give it the final mode, rename it over ``final``."""
    try:
        mode = final.stat().st_mode & 0o7777 if final.is_file() else 0o666 & ~_umask()
    except OSError:
        mode = 0o666 & ~_umask()
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.chmod(tmp, mode)
    os.replace(tmp, final)
    _fsync_dir(final.parent)


def write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (see the module docstring)."""
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)
    return Path(path)


def write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    return write_bytes(path, text.encode("utf-8"))


def check_replaceable_dir(path: str | os.PathLike, flag: str, owned: Iterable[str]) -> Path:
    """:func:`check_dir`, and that :func:`staged_dir` may replace ``path`` whole: every entry in it matches one
    of the ``owned`` names or glob patterns (what the command writes there), and it is neither the working
    folder nor one above it. Raises an InputError naming ``flag`` otherwise."""
    p = check_dir(path, flag)
    if not p.exists():
        return p
    here, target = Path.cwd().resolve(), p.resolve()
    if target == here or target in here.parents:
        raise InputError("is the working folder (or holds it); the outputs replace the folder whole: name a "
                         "folder of their own", source=str(path), field=flag)
    patterns = tuple(owned)
    foreign = sorted(e.name for e in p.iterdir() if not any(fnmatch.fnmatchcase(e.name, g) for g in patterns))
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise InputError(f"holds files this command does not write ({shown}); the outputs replace the folder "
                         "whole, so name an empty or new folder, or one an earlier run of this command wrote",
                         source=str(path), field=flag)
    return p


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux ``renameat2(RENAME_EXCHANGE)``); False where the system cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EPERM, errno.ENOTSUP):  # a file system or kernel without it
        return False
    raise OSError(err, os.strerror(err), str(b))


@contextlib.contextmanager
def staged_dir(path: str | os.PathLike) -> Iterator[Path]:
    """A new temporary folder beside ``path`` to write a set of outputs into. On a clean exit it takes the
    place of ``path`` whole, in one exchange where the system has one (else two renames, with ``path``
    missing for a moment between them), and the previous folder is removed; on an error or an interrupt it is
    removed and ``path`` is untouched. Check ``path`` first with :func:`check_replaceable_dir`."""
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.", suffix=".tmp"))
    try:
        yield tmp
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp's 0o700 is for the temporary name, not the outputs
        if not final.exists():
            os.rename(tmp, final)
        elif _exchange(tmp, final):
            shutil.rmtree(tmp)  # now the previous folder
        else:
            old = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.", suffix=".old"))
            os.rename(final, old / final.name)
            os.rename(tmp, final)
            shutil.rmtree(old)
        _fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

"""Writing files as any careful tool does: with the user's umask, into folders checked first,
and a failure said in one line.

Python's tempfile.mkstemp and mkdtemp, and the safetensors package, create files 0600 and
folders 0700 whatever the umask: a team's shared disk could not read a checkpoint or a
prepared folder made that way. So folders here are made by os.mkdir (the umask applies), and
a file another library created is given the mode open() would have given it (`shareable`).
"""
import contextlib
import errno
import os
import shutil
import uuid
from pathlib import Path


class WriteError(RuntimeError):
    """A file or folder that cannot be written (read-only, full, not a folder); the message
    names it and says why."""


def _umask():
    """The process's umask, read without changing it where /proc says it (os.umask can only
    read it by setting it, for a moment, for every thread)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def shareable(path):
    """Give path the mode a new file (0666) or folder (0777) gets from the umask."""
    mode = 0o777 if os.path.isdir(path) else 0o666
    os.chmod(path, mode & ~_umask())


def new_folder(parent, prefix):
    """A new empty folder parent/<prefix><8 random hex digits>, made with the umask's mode."""
    while True:
        folder = Path(parent) / f"{prefix}{uuid.uuid4().hex[:8]}"
        try:
            folder.mkdir()
            return folder
        except FileExistsError:
            continue


def remove(path):
    """Delete path: a file, a symbolic link (not what it points to) or a folder; nothing if
    it is not there."""
    path = Path(path)
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def fsync_folder(folder):
    """Make the names in folder (a rename, a new file) durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def reason(error):
    """Why an OSError stopped a write, in a few words."""
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return "the disk is full"
    if error.errno == errno.EROFS:
        return "the file system is read-only"
    if error.errno in (errno.EACCES, errno.EPERM):
        return "permission denied"
    return error.strerror or str(error)


@contextlib.contextmanager
def replacing(path):
    """A hidden temporary beside path (.NAME.tmp), for the block to write: when the block
    ends it replaces path whole (a rename); when anything stops it (an error, Ctrl-C, a
    SIGTERM) the temporary is removed and path is as it was."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.tmp")
    try:
        yield temporary
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def writing(what):
    """An OSError inside the block becomes a WriteError naming `what` and why."""
    try:
        yield
    except OSError as error:
        raise WriteError(f"cannot write {what}: {reason(error)}") from None


def unwritable(path):
    """Why a folder `path` (made with its parents if missing) cannot be written, or None."""
    path = Path(path)
    existing = path
    while not existing.exists() and existing != existing.parent:
        if existing.is_symlink():
            return f"{existing} is a broken symbolic link"
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is a file, not a folder"
    if not os.access(existing, os.W_OK | os.X_OK):
        try:
            read_only = os.statvfs(existing).f_flag & os.ST_RDONLY
        except OSError:
            read_only = False
        return f"{existing} is {'on a read-only file system' if read_only else 'not writable'}"
    return None

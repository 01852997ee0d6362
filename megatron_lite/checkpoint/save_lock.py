"""One run per save directory, and a save directory that accepts files: both checked at start-up.

Two runs saving into one `--save` directory delete each other's saves in progress and can commit a
checkpoint whose data files the other run removed. The coordinator of a run therefore holds an exclusive
`flock` on `DIR/run.lock` for the run's lifetime; the file records the holder's host and pid so that a
refused run can say who holds it. The lock is released at close (or when its holder is garbage-collected:
a run that ended on an error inside a longer-lived process), and by the operating system when the
process dies (kill -9 included), so a crashed run never leaves the directory locked. A forked child (a
data-loader worker) closes its inherited copy of the descriptor at once: otherwise the lock would live on
in workers that outlive a killed run by seconds, and the restart would be refused. The file itself stays:
deleting it would let a run waiting on the old file and a run creating a new one both succeed.

A directory that cannot be written (a read-only mount, a path under a regular file) would otherwise fail
only at the first save, possibly after the whole run: every rank creates and removes a probe file first.
"""

from __future__ import annotations

import fcntl
import os
import socket
import weakref

from megatron_lite import files

LOCK_FILE = "run.lock"
_held_locks: set[weakref.finalize] = set()  # the unlock finalizers of the locks this process holds


def _close_inherited_locks() -> None:
    """In a forked child: close the copies of the parent's lock descriptors (closing a copy never releases
    the lock) and forget their finalizers (the child must never close those numbers again)."""
    for unlock in _held_locks:
        detached = unlock.detach()
        if detached is not None:
            _, _, (fd,), _ = detached
            os.close(fd)
    _held_locks.clear()


os.register_at_fork(after_in_child=_close_inherited_locks)


def unwritable(root: str) -> str | None:
    """Why this process cannot create files in `root` (made if missing), or None when it can."""
    return files.unwritable(files.Location("--save", root, is_file=False))


class SaveLock:
    """An exclusive lock on a save directory, held from `acquire` until `release` (or process exit)."""

    def __init__(self, root: str, fd: int):
        self.root = root
        # Closing the last descriptor of the open file releases the flock; runs once, at release or at
        # garbage collection.
        self._unlock = weakref.finalize(self, os.close, fd)
        _held_locks.add(self._unlock)

    @classmethod
    def acquire(cls, root: str) -> tuple[SaveLock | None, str | None]:
        """The lock, or (None, a one-line reason naming the run that holds it)."""
        path = os.path.join(root, LOCK_FILE)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as error:
            return None, f"cannot create the lock file {path}: {error.strerror or error}"
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "a run that has not yet recorded itself"
            os.close(fd)
            return None, (f"--save {root} is in use by another run ({holder}); one run per save directory: wait "
                          f"for it to finish, or choose another --save")
        except OSError as error:  # a file system without flock
            os.close(fd)
            return None, f"cannot lock {path}: {error.strerror or error}"
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"host {socket.gethostname()} pid {os.getpid()}\n".encode(), 0)
        return cls(root, fd), None

    def release(self) -> None:
        _held_locks.discard(self._unlock)
        self._unlock()

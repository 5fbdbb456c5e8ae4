# The one flock helper of the host code: the patch state lock, the rollout journal lock, the
# provision lock and the server lock are all this. Standard library only, Python 3.8+.
import errno
import fcntl
import os
import time


class LockBusy(Exception):
    """The lock was still held when the wait ran out."""


class FileLock(object):
    """An exclusive flock on PATH (made, with its folder, when missing), waiting up to `timeout`
    seconds (None: for as long as it takes). Closing the file releases it, and so does a killed
    process. `waited` is how long it took; `fd` is open while held."""

    def __init__(self, path, timeout=None, poll=0.05):
        self.path, self.timeout, self.poll = path, timeout, poll
        self.fd, self.waited = None, 0.0

    def __enter__(self):
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        start = time.monotonic()
        try:
            if self.timeout is None:
                fcntl.flock(self.fd, fcntl.LOCK_EX)
            else:
                self._wait(start + self.timeout)
        except BaseException:
            os.close(self.fd)
            raise
        self.waited = time.monotonic() - start
        return self

    def _wait(self, deadline):
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
            if time.monotonic() >= deadline:
                raise LockBusy(os.pread(self.fd, 200, 0).decode(errors="replace").strip())
            time.sleep(self.poll)

    def __exit__(self, *exc):
        os.close(self.fd)

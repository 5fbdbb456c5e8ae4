# Prepended to every host-side script by toolkit.hostrun. Standard library only:
# this code runs on the host with whatever Python 3 it has.
import base64 as _b64
import hashlib as _hashlib
import json as _json
import sys as _sys
import traceback as _tb


def _run_main(main, encoded_args, marker):
    args = _json.loads(_b64.b64decode(encoded_args).decode())
    try:
        answer = main(args)
        code = 0
    except SystemExit:
        raise
    except BaseException as exc:  # report, do not hide: the control side raises it
        answer = {"_error": "%s: %s" % (type(exc).__name__, exc), "_traceback": _tb.format_exc()}
        code = 1
    _sys.stdout.write("\n" + marker + _json.dumps(answer) + "\n")
    _sys.stdout.flush()
    _sys.exit(code)


def sha256_file(path):
    """Hex sha256 of a file, read in 1 MiB blocks; None when there is no such file."""
    try:
        with open(path, "rb") as f:
            digest = _hashlib.sha256()
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
            return digest.hexdigest()
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None


def owner_name(path):
    """The user name owning PATH ("uid N" without one, "?" when it cannot be read)."""
    import os
    try:
        import pwd
        uid = os.stat(path).st_uid
        try:
            return pwd.getpwuid(uid).pw_name
        except KeyError:
            return "uid %d" % uid
    except (ImportError, OSError):
        return "?"

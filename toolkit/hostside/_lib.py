# What every host run needs: the entry that toolkit.hostrun's bootstrap calls, and small file
# helpers. Standard library only: this code runs on the host with whatever Python 3 it has.
import base64
import hashlib
import importlib
import json
import sys
import traceback


def run_entry(name, function, encoded_args, marker):
    """Import the package's module NAME and call its FUNCTION: with the base64 JSON arguments,
    answering one marked JSON line (exit 1 with `_error` when it raised); with none (a payload
    kept in a file), with the command line's arguments, its return value the exit code.
    FUNCTION None only imports NAME and answers the package's modules then loaded (tests check
    that a call's zip holds everything its entry imports)."""
    if encoded_args is None:
        entry = getattr(importlib.import_module("%s.%s" % (__package__, name)), function)
        sys.exit(entry(*sys.argv[1:]))
    try:
        args = json.loads(base64.b64decode(encoded_args).decode())
        module = importlib.import_module("%s.%s" % (__package__, name))
        if function is None:
            answer = {"imported": sorted(m for m in sys.modules if m.split(".")[0] == __package__)}
        else:
            answer = getattr(module, function)(args)
        code = 0
    except SystemExit:
        raise
    except BaseException as exc:  # report, do not hide: the control side raises it
        answer = {"_error": "%s: %s" % (type(exc).__name__, exc), "_traceback": traceback.format_exc()}
        code = 1
    sys.stdout.write("\n" + marker + json.dumps(answer) + "\n")
    sys.stdout.flush()
    sys.exit(code)


def sha256_file(path):
    """Hex sha256 of a file, read in 1 MiB blocks; None when there is no such file."""
    try:
        with open(path, "rb") as f:
            digest = hashlib.sha256()
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
            return digest.hexdigest()
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None


def user_name():
    """The name of the user this runs as ("uid N" without one)."""
    import os
    try:
        import pwd
        return pwd.getpwuid(os.geteuid()).pw_name
    except (ImportError, KeyError):
        return "uid %d" % os.geteuid()


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

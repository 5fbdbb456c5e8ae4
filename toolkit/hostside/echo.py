# A trivial host-side script used by tests and as the smallest example.
import os
import platform


def main(args):
    return {"echo": args, "python": platform.python_version(), "pid": os.getpid()}

# The smallest host-side script: answers with its arguments (used by tests and `invoke facts`-style
# reachability checks). `{"raise": "text"}` makes it fail, to show how host errors come back.
import os
import platform


def main(args):
    if args.get("raise"):
        raise KeyError(args["raise"])
    return {"echo": args, "python": platform.python_version(), "pid": os.getpid()}

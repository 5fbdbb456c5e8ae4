# The wheels already in the host's wheelhouse folder, by sha256, so that the control side
# sends only what is missing or different. Hashes are remembered per (name, size, mtime) in
# a small cache file beside the wheels: the gpu stack's wheels are several GB, and hashing
# them on every run would cost seconds. Standard library only, Python 3.8+.
import json
import os

from ._lib import sha256_file

CACHE = ".sha256-cache.json"


def main(args):
    folder = args["dir"]
    if args.get("create"):
        os.makedirs(folder, exist_ok=True)
    if not os.path.isdir(folder):
        return {"dir": folder, "exists": False, "wheels": {}, "hashed": 0}
    try:
        with open(os.path.join(folder, CACHE)) as f:
            cache = json.load(f)
    except (OSError, ValueError):
        cache = {}
    wheels, fresh, hashed = {}, {}, 0
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if not (name.endswith(".whl") and os.path.isfile(path)):
            continue
        stat = os.stat(path)
        key = "%s:%d:%d" % (name, stat.st_size, stat.st_mtime_ns)
        if key not in cache:
            cache[key] = sha256_file(path)
            hashed += 1
        fresh[key] = cache[key]
        wheels[name] = cache[key]
    if args.get("create") and hashed:
        tmp = os.path.join(folder, CACHE + ".tmp")
        with open(tmp, "w") as f:
            json.dump(fresh, f)
        os.rename(tmp, os.path.join(folder, CACHE))
    return {"dir": folder, "exists": True, "wheels": wheels, "hashed": hashed}

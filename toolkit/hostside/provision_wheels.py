# The wheels already in the host's wheelhouse folder, by sha256, so that the control side
# sends only what is missing or different. Standard library only, Python 3.8+.
import hashlib
import os


def _sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def main(args):
    folder = args["dir"]
    if args.get("create"):
        os.makedirs(folder, exist_ok=True)
    if not os.path.isdir(folder):
        return {"dir": folder, "exists": False, "wheels": {}}
    wheels = {}
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if name.endswith(".whl") and os.path.isfile(path):
            wheels[name] = _sha256(path)
    return {"dir": folder, "exists": True, "wheels": wheels}

"""Apply a git-style unified diff (a/ b/ paths) to a directory, stdlib only.

Usage: python3 apply_patch.py PATCH DIR [--check]

For the GPU machine, whose image may lack git and patch. Every hunk's context
and removed lines must match exactly (no fuzz); as `git apply` does, a hunk
whose lines are not at the stated line is placed at the nearest line where they
all are (an offset: a diff of a stack written before an earlier diff of the same
file grew it). On any mismatch nothing is written and the exit status is 1. New files
(--- /dev/null) are created. Prints one line per file.
"""
import re
import sys
from pathlib import Path

HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def parse(text):
    files, cur, hunk = [], None, None
    for line in text.splitlines(keepends=True):
        if line.startswith("diff --git "):
            cur = {"old": None, "new": None, "hunks": []}
            files.append(cur)
            hunk = None
        elif cur is not None and hunk is None and line.startswith("--- "):
            cur["old"] = line[4:].strip()
        elif cur is not None and hunk is None and line.startswith("+++ "):
            cur["new"] = line[4:].strip()
        elif line.startswith("@@"):
            m = HUNK.match(line)
            hunk = {"old_start": int(m.group(1)), "lines": []}
            cur["hunks"].append(hunk)
        elif hunk is not None and line[:1] in (" ", "+", "-"):
            hunk["lines"].append(line)
        elif hunk is not None and line.startswith("\\"):
            continue  # "\ No newline at end of file"
    return files


def _place(src, old, stated, earliest):
    """The line where the hunk's old lines all match, nearest the stated one and not before
    the end of the previous hunk; None if nowhere."""
    starts = sorted(range(earliest, len(src) - len(old) + 1), key=lambda start: abs(start - stated))
    return next((start for start in starts if src[start:start + len(old)] == old), None)


def apply_file(entry, root):
    new = entry["new"]
    rel = new[2:] if new.startswith("b/") else new
    target = root / rel
    if entry["old"] == "/dev/null":
        if target.exists():
            raise ValueError(f"{rel}: new file already exists")
        src = []
    else:
        src = target.read_text().splitlines(keepends=True)
    out, pos = [], 0
    for h in entry["hunks"]:
        stated = h["old_start"] - 1 if h["old_start"] > 0 else 0
        start = _place(src, [line[1:] for line in h["lines"] if line[0] in (" ", "-")], stated, pos)
        if start is None:
            raise ValueError(f"{rel}: hunk at line {h['old_start']} does not match")
        out.extend(src[pos:start])
        pos = start
        for line in h["lines"]:
            tag, body = line[0], line[1:]
            if tag in (" ", "-"):
                pos += 1
                if tag == " ":
                    out.append(body)
            else:
                out.append(body)
    out.extend(src[pos:])
    return target, "".join(out)


def main(argv):
    if len(argv) < 2:
        print(__doc__)
        return 2
    patch, root = Path(argv[0]), Path(argv[1])
    check = "--check" in argv
    results = []
    try:
        for entry in parse(patch.read_text()):
            results.append(apply_file(entry, root))
    except (OSError, ValueError) as e:
        print(f"apply_patch: {e}; nothing written")
        return 1
    for target, text in results:
        if not check:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
        print(("checked " if check else "patched ") + str(target))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

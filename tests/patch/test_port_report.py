"""`invoke patch port`'s per-hunk report must be exact: the real dyn-disable patchset (every hunk of its
diffs) ported from the real 0.5.11 wheel to releases made from that same wheel, whose differences
are known: none, a shift of N lines in one file, one changed context line. Also a wheel whose
RECORD lists folders."""
import base64
import csv
import hashlib
import io
import shutil
import zipfile
from pathlib import Path

import pytest
from unidiff import PatchSet

from toolkit.patch import authoring, porting

from .conftest import VERSION

ROOT = Path(__file__).resolve().parents[2]
SCHEDULE = "sglang/srt/managers/schedule_batch.py"
EMPTY_SHA = base64.urlsafe_b64encode(hashlib.sha256(b"").digest()).rstrip(b"=").decode()


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def make_release(wheel, cache: Path, version: str, edits=None, folder_rows=(), stale=()) -> Path:
    """A copy of WHEEL as release VERSION: dist-info renamed, METADATA and RECORD rewritten;
    `edits` {path: function(bytes) -> bytes} change files (their RECORD hashes follow);
    `folder_rows` are RECORD rows for folders, as some wheel builders write them; files in `stale`
    keep their old RECORD hash (a corrupt wheel)."""
    old_info, new_info = wheel.dist_info, f"sglang-{version}.dist-info"
    target = cache / "wheels" / wheel.path.name.replace(f"-{wheel.version}-", f"-{version}-")
    edits = edits or {}
    with zipfile.ZipFile(wheel.path) as source, zipfile.ZipFile(target, "w", zipfile.ZIP_STORED) as out:
        rows, record_name = [], f"{old_info}/RECORD"
        for info in source.infolist():
            name = info.filename.replace(old_info + "/", new_info + "/", 1)
            data = source.read(info.filename)
            if info.filename == record_name:
                continue
            if info.filename == f"{old_info}/METADATA":
                data = data.replace(f"\nVersion: {wheel.version}\n".encode(), f"\nVersion: {version}\n".encode(), 1)
            hashed = data
            if info.filename in edits:
                data = edits[info.filename](data)
            out.writestr(name, data)
            if not name.endswith("/"):
                hashed = hashed if info.filename in stale else data
                rows.append([name, _record_hash(hashed), str(len(hashed))])
        text = io.StringIO()
        csv.writer(text, lineterminator="\n").writerows(rows)
        text.write("".join(row + "\n" for row in folder_rows) + f"{new_info}/RECORD,,\n")
        out.writestr(f"{new_info}/RECORD", text.getvalue())
    return target


OLD_DIFFS = ("0001-dyn-disable.patch", "0002-dyn-disable-metrics.patch")


@pytest.fixture
def dyn_patchsets(tmp_path, monkeypatch) -> Path:
    """A private patchsets/ with the real dyn-disable: its 0.5.11 diffs that touch disjoint hunks
    (0001, 0002), so that each diff hunk is one hunk of the change the port tries (later diffs
    edit lines 0001 adds, and the port's change holds their sum)."""
    folder = tmp_path / "patchsets"
    (folder / "dyn-disable" / VERSION).mkdir(parents=True)
    for name in ("patchset.toml", "hooks.py"):
        shutil.copy(ROOT / "patchsets" / "dyn-disable" / name, folder / "dyn-disable")
    for diff in OLD_DIFFS:
        shutil.copy(ROOT / "patchsets" / "dyn-disable" / VERSION / diff, folder / "dyn-disable" / VERSION)
    monkeypatch.setenv("TOOLKIT_PATCHSETS", str(folder))
    return folder


def old_hunks() -> list[tuple[str, int, int, int]]:
    """(path, number in its file, old start, old length) of every hunk of dyn-disable on 0.5.11,
    over its diffs in the order they apply (a file's hunks are numbered across them)."""
    hunks, count = [], {}
    for patch in [ROOT / "patchsets" / "dyn-disable" / VERSION / diff for diff in OLD_DIFFS]:
        for pf in PatchSet(patch.read_text()):
            for h in pf:
                count[pf.path] = count.get(pf.path, 0) + 1
                hunks.append((pf.path, count[pf.path], h.source_start, h.source_length))
    return hunks


def report(result) -> dict:
    return {(h.path, h.number): (h.status, h.offset) for h in result.hunks}


def test_identical_release_reports_every_hunk_as_is(release_cache, dyn_patchsets, sglang_wheel):
    make_release(sglang_wheel, release_cache, "0.5.11.post91")
    result = porting.port("dyn-disable", "0.5.11.post91", source=VERSION)
    assert report(result) == {(path, n): ("as is", 0) for path, n, _, _ in old_hunks()}
    total = len(old_hunks())
    assert len(result.hunks) == total and result.clean and result.check.ok
    assert (result.count("as is"), result.count("moved"), result.count("conflicted")) == (total, 0, 0)


def test_a_known_shift_moves_exactly_the_hunks_below_it(release_cache, dyn_patchsets, sglang_wheel):
    hunks = [h for h in old_hunks() if h[0] == SCHEDULE]
    (_, _, start1, length1), (_, _, start2, _) = hunks[0], hunks[1]
    after = start1 + length1   # first line below hunk 1's context (1-based): 10 lines go in before it
    assert after < start2, "a line between hunks 1 and 2 that neither touches"

    def insert(data: bytes) -> bytes:
        lines = data.splitlines(keepends=True)
        return b"".join(lines[:after - 1] + [b"# a line upstream added\n"] * 10 + lines[after - 1:])

    make_release(sglang_wheel, release_cache, "0.5.11.post92", edits={SCHEDULE: insert})
    result = porting.port("dyn-disable", "0.5.11.post92", source=VERSION)
    expected = {(path, n): ("as is", 0) for path, n, _, _ in old_hunks()}
    expected.update({(SCHEDULE, n): ("moved", 10) for n in (2, 3, 4)})
    assert report(result) == expected
    assert result.clean and result.check.ok   # the merge put each hunk where its code went


def test_a_changed_context_line_conflicts_that_hunk_only(release_cache, dyn_patchsets, sglang_wheel):
    _, _, start, _ = [h for h in old_hunks() if h[0] == SCHEDULE][2]

    def change(data: bytes) -> bytes:
        lines = data.splitlines(keepends=True)
        lines[start - 1] = lines[start - 1].rstrip(b"\n") + b"  # changed upstream\n"  # the hunk's first line
        return b"".join(lines)

    make_release(sglang_wheel, release_cache, "0.5.11.post93", edits={SCHEDULE: change})
    result = porting.port("dyn-disable", "0.5.11.post93", source=VERSION)
    expected = {(path, n): ("as is", 0) for path, n, _, _ in old_hunks()}
    expected[(SCHEDULE, 3)] = ("conflicted", 0)
    assert report(result) == expected
    assert not result.clean and not (dyn_patchsets / "dyn-disable" / "0.5.11.post93").exists()
    hunk = next(h for h in result.hunks if h.status == "conflicted")
    # upstream's change is three lines above the patch's own: git merges both, and the port
    # lists the file for review instead of writing the diff
    assert hunk.detail == "merged by git's three-way merge although its lines changed: review"
    assert result.review == [SCHEDULE] and result.markers == []


def test_a_wheel_whose_record_lists_folders_ports(release_cache, dyn_patchsets, sglang_wheel):
    rows = ["sglang/,,", f"sglang/srt/,sha256={EMPTY_SHA},0", f"sglang/srt/managers/,sha256={EMPTY_SHA},0"]
    make_release(sglang_wheel, release_cache, "0.5.11.post94", folder_rows=rows)
    result = porting.port("dyn-disable", "0.5.11.post94", source=VERSION)
    assert result.clean and result.count("as is") == len(old_hunks())
    assert (result.tree / "sglang" / "srt" / "managers").is_dir()


def test_a_port_that_fails_while_laying_out_leaves_no_tree(release_cache, dyn_patchsets, sglang_wheel):
    # a file whose bytes do not match RECORD: the layout of the new release stops there
    make_release(sglang_wheel, release_cache, "0.5.11.post95", edits={SCHEDULE: lambda data: data[:-1]},
                 stale={SCHEDULE})
    with pytest.raises(Exception, match="does not match the wheel's RECORD"):
        porting.port("dyn-disable", "0.5.11.post95", source=VERSION)
    assert not authoring.edit_dir("dyn-disable").exists()
    make_release(sglang_wheel, release_cache, "0.5.11.post96")
    assert porting.port("dyn-disable", "0.5.11.post96", source=VERSION).clean   # no --fresh needed

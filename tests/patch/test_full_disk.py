"""Full disks, for real: the host's site folder and its state on a 1 MiB tmpfs (mounted by the
test, which needs root), filled by a file to a known number of free bytes, or filled up by the
host run itself at a named point (tests/patch/faults.py). Real sshd, the real wheel's files.

A disk that cannot take the run is refused before anything is written (a dry run says so too),
naming the folder, the bytes the run needs there and the bytes free. A disk that fills up while
the run writes its backups, journal or new files leaves nothing behind: the run removes its
temporary files and journal itself and no file changes. One that fills up after every file was
replaced keeps the journal (the files are all new, the state is not), and the next command
finishes the run once there is space."""
import dataclasses
import json
import os
import re
import shutil
import subprocess
import tempfile
import zipfile
from pathlib import Path

import pytest

from toolkit.patch import patching

from .conftest import VERSION, sha256
from .faults import armed

SIZE = 1 << 20
FILL = """
import os
fd = os.open(%r, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
try:
    while True:
        os.write(fd, b"\\0" * 4096)
except OSError:
    pass
finally:
    os.close(fd)
"""


@pytest.fixture
def small_disk():
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    folder = Path(tempfile.mkdtemp(prefix="toolkit-full-", dir="/tmp"))
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SIZE},mode=0755", "tmpfs", str(folder)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        folder.rmdir()
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=False)
        folder.rmdir()


@pytest.fixture
def disk_host(small_disk, sandbox_host, sglang_wheel, patchsets_dir):
    """A bare site folder on the small disk with the files the test patchsets touch (verify
    judges them all) and the dist-info, as `pythonpath` of the sandbox host; its state goes to
    <site>/.toolkit, on the same disk."""
    site = small_disk / "site"
    for rel in {p for ps in patching.load_patchsets().values() for p in ps.touched()}:
        if sglang_wheel.has(rel):
            (site / rel).parent.mkdir(parents=True, exist_ok=True)
            (site / rel).write_bytes(sglang_wheel.read(rel))
    dist = site / f"sglang-{VERSION}.dist-info"
    dist.mkdir()
    with zipfile.ZipFile(sglang_wheel.path) as wheel:
        for name in ("METADATA", "RECORD"):
            (dist / name).write_bytes(wheel.read(f"{sglang_wheel.dist_info}/{name}"))
    host = dataclasses.replace(sandbox_host, name="sandbox", venv=None, pythonpath=str(site), state_dir=None)
    return host, site


def free(folder: Path) -> int:
    st = os.statvfs(folder)
    return st.f_bavail * st.f_frsize


def fill_to(disk: Path, leave: int) -> Path:
    """Take the disk's free space down to `leave` bytes (a multiple of the page size)."""
    filler = disk / "filler"
    with open(filler, "ab") as f:
        f.write(b"\0" * (free(disk) - leave))
    assert free(disk) == leave
    return filler


def pristine(site, wheel) -> bool:
    return all(sha256(site / p) == wheel.record[p] for p in patching.load_patchsets()["three"].touched())


def leftovers(site: Path) -> list[str]:
    """Temporary files of any run, and the journal."""
    found = [str(p) for p in site.rglob("*.toolkit-new")] + [str(p) for p in site.rglob("*.tmp[0-9]*")]
    return sorted(found + [str(p) for p in site.rglob("journal.json")])


def test_a_disk_without_room_is_refused_before_anything_is_written(disk_host, small_disk, sglang_wheel):
    host, site = disk_host
    fill_to(small_disk, 4096)
    for dry_run in (True, False):
        with pytest.raises(patching.PatchRefused) as refused:
            patching.apply(host, "three", dry_run=dry_run)
        found = re.fullmatch(rf"not enough free space on sandbox; nothing written: {site} has (\d+) bytes free,"
                             rf" the run needs (\d+) there", refused.value.reason)
        assert found, refused.value.reason
        assert int(found.group(1)) == 4096 and int(found.group(2)) > 4096
    need = int(found.group(2))
    assert pristine(site, sglang_wheel) and not (site / ".toolkit").exists()

    os.unlink(small_disk / "filler")   # exactly what it says it needs: enough
    fill_to(small_disk, need)
    applied = patching.apply(host, "three")
    assert applied.changed == 3 and patching.verify(host).ok and leftovers(site) == []


def test_the_host_run_checks_the_space_again(disk_host, small_disk, sglang_wheel):
    """The disk fills between the probe and the host run (at the run's first step): the host run
    refuses with the same figures, and writes nothing."""
    host, site = disk_host
    filler = small_disk / "filler"
    code = FILL % str(filler)
    with armed("after-lock", run=code), pytest.raises(patching.PatchRefused) as refused:
        patching.apply(host, "three")
    assert re.fullmatch(rf"not enough free space; nothing written: {site} has \d+ bytes free, the run needs \d+"
                        rf" there", refused.value.reason), refused.value.reason
    assert pristine(site, sglang_wheel) and leftovers(site) == []
    assert not (site / ".toolkit" / "patch" / "state.json").exists()


@pytest.mark.parametrize("point, what", [
    ("after-checks", r"the backup of sglang/srt/utils/\w+\.py"),
    ("after-backups", "the journal"),
    ("after-prepare", r"the new sglang/srt/utils/\w+\.py"),
    ("after-new-files", "the journal"),
])
def test_a_disk_that_fills_while_writing_leaves_nothing_behind(disk_host, small_disk, sglang_wheel, point, what):
    host, site = disk_host
    filler = small_disk / "filler"
    with armed(point, run=FILL % str(filler)), pytest.raises(patching.PatchRefused) as refused:
        patching.apply(host, "three")
    reason = refused.value.reason
    assert re.match(rf"no space left on the file system of {site}\S* \(No space left on device\) while writing"
                    rf" {what}: the run needs about [1-9]\d* bytes there, \d+ are free; ", reason), reason
    assert pristine(site, sglang_wheel)
    assert leftovers(site) == [], "the run removed its temporary files and its journal itself"
    assert not (site / ".toolkit" / "patch" / "state.json").exists()
    checked = patching.verify(host)
    assert checked.ok and checked.recovered is None and checked.notes == []

    os.unlink(filler)
    assert patching.apply(host, "three").changed == 3 and patching.verify(host).ok and leftovers(site) == []


def test_a_disk_that_fills_after_the_renames_keeps_the_journal_and_the_next_command_finishes(
        disk_host, small_disk, sglang_wheel):
    host, site = disk_host
    filler = small_disk / "filler"
    with armed("after-rename-3", run=FILL % str(filler)), pytest.raises(patching.PatchFailed) as failed:
        patching.apply(host, "three")
    assert re.match(rf"no space left on the file system of {site}/\.toolkit/patch \(No space left on device\)"
                    rf" while writing the state: .*; all 3 file\(s\) hold the new content and the journal says so",
                    str(failed.value)), str(failed.value)
    assert f"the next `invoke patch verify --host {host.name}`, apply or revert finishes the run" in str(failed.value)
    state_dir = site / ".toolkit" / "patch"
    assert json.loads((state_dir / "journal.json").read_text())["phase"] == "commit"
    assert not (state_dir / "state.json").exists()

    os.unlink(filler)
    finished = patching.verify(host)
    assert finished.recovered["outcome"] == "rolled forward" and finished.ok
    assert finished.stack == ["three"] and leftovers(site) == []
    assert patching.revert(host).record_ok and pristine(site, sglang_wheel)
    shutil.rmtree(state_dir)

"""Patchsets per SGLang release and `port`: the real 0.5.11 and 0.5.17 wheels, real git, real sshd.

The conflicts here are real: the synthetic patchsets append lines to files whose ends changed
between 0.5.11 and 0.5.17 (twenty), or add a line beside a header upstream rewrote (three).
"""
import json
import re
from pathlib import Path

import git
import pytest
from unidiff import PatchSet

from tests.helpers import invoke
from toolkit.patch import authoring, compiler, patching, patchsets, porting

from .conftest import DATA, NEXT, VERSION, sha256

ROOT = Path(__file__).resolve().parents[2]
AUTH = "sglang/srt/utils/auth.py"
AS_IS, MOVED = "sglang/srt/utils/aio_rwlock.py", "sglang/srt/utils/device_timer.py"


def statuses(result) -> dict[str, tuple]:
    return {h.path: (h.status, h.offset) for h in result.hunks}


def patch_cli(*args):
    done = invoke("patch", *args, columns=220)
    return done.returncode, done.stdout, done.stderr


def test_apply_on_a_release_the_patchset_has_no_diff_for_is_refused(next_host, patchsets_dir):
    site = next(Path(next_host.venv).glob("lib/python*/site-packages"))
    before = sha256(site / AUTH)
    with pytest.raises(patching.PatchRefused) as refused:
        patching.apply(next_host, "one-file")
    assert refused.value.reason == (
        f"sandbox has sglang {NEXT}: one-file has no diff for sglang {NEXT} (it has: {VERSION});"
        f" port it with `invoke patch port one-file --to {NEXT}`; nothing written")
    assert sha256(site / AUTH) == before and not (Path(next_host.toolkit_state_dir) / "patch").exists()


def test_clean_port_writes_the_new_release_and_both_releases_apply(release_cache, patchsets_dir, host, site,
                                                                    next_host, sglang_wheel, next_wheel):
    code, out, err = patch_cli("port", "one-file", "--to", NEXT)
    assert code == 0, err
    written = patchsets_dir / "one-file" / NEXT / "0001-one-file.patch"
    assert f"one-file ported to {NEXT} (1 as is, 0 moved, 0 conflicted): wrote {written}" in out
    assert f"ok: one-file compiles against {NEXT}: 1 files, 1 hunks, +1 -1 lines" in out
    code, out, _ = patch_cli("list")
    assert code == 0 and re.search(rf"one-file\s+│\s+{VERSION}, {NEXT}\s", out) and "pair-base" in out
    assert patching.load_patchsets()["one-file"].versions == [VERSION, NEXT]

    assert patching.apply(next_host, "one-file").changed == 1
    next_site = Path(next(Path(next_host.venv).glob("lib/python*/site-packages")))
    assert "error_status_code: int = 403  # synthetic one-file" in (next_site / AUTH).read_text()
    assert patching.verify(next_host).ok
    assert patching.revert(next_host).record_ok and sha256(next_site / AUTH) == next_wheel.record[AUTH]
    assert patching.apply(host, "one-file").changed == 1  # the 0.5.11 diff still serves 0.5.11
    assert patching.verify(host).ok and sha256(site / AUTH) != sglang_wheel.record[AUTH]


def _moved_patchset(folder: Path) -> None:
    """A patchset of two of twenty's hunks: one at the same line in 0.5.17, one further down."""
    twenty = PatchSet((DATA / "twenty" / VERSION / "0001-twenty.patch").read_text())
    keep = "".join(str(pf) for pf in twenty if pf.path in (AS_IS, MOVED))
    (folder / "moved" / VERSION).mkdir(parents=True)
    (folder / "moved" / VERSION / "0001-moved.patch").write_text(keep)
    (folder / "moved" / "patchset.toml").write_text('name = "moved"\nsummary = "s"\npackage = "sglang"\n'
                                                    'order = 80\nrequires = []\n')


def test_moved_hunk_is_reported_with_its_offset_and_lands_where_the_code_went(release_cache, patchsets_dir,
                                                                            next_wheel):
    _moved_patchset(patchsets_dir)
    result = porting.port("moved", NEXT)
    assert result.clean and statuses(result) == {AS_IS: ("as is", 0), MOVED: ("moved", 22)}
    assert result.check.ok and result.check.versions == [NEXT]
    image = compiler.compile_stack([patchsets.load_all()["moved"]], NEXT)
    assert image.files[MOVED].content == next_wheel.read(MOVED) + b"\n# synthetic twenty: device_timer.py\n"
    new = PatchSet((patchsets_dir / "moved" / NEXT / "0001-moved.patch").read_text())
    old = PatchSet((patchsets_dir / "moved" / VERSION / "0001-moved.patch").read_text())
    start = {pf.path: pf[0].source_start for pf in new}
    assert start[MOVED] == {pf.path: pf[0].source_start for pf in old}[MOVED] + 22


def test_conflicts_stay_in_the_work_tree_and_refresh_finishes_the_port(release_cache, patchsets_dir):
    result = porting.port("twenty", NEXT)
    assert not result.clean and not (patchsets_dir / "twenty" / NEXT).exists()
    found = statuses(result)
    conflicted = sorted(p for p, (status, _) in found.items() if status == "conflicted")
    assert conflicted == ["sglang/srt/utils/network.py", "sglang/srt/utils/numa_utils.py",
                          "sglang/srt/utils/profile_utils.py"]
    assert (result.count("as is"), result.count("moved"), result.count("conflicted")) == (10, 7, 3)
    assert result.markers == conflicted and all(h.detail == "conflict markers in the file"
                                                for h in result.hunks if h.status == "conflicted")
    assert result.next_steps()[-1] == f"invoke patch refresh twenty   # writes patchsets/twenty/{NEXT}/ and checks it"
    tree = result.tree
    text = (tree / conflicted[0]).read_text()
    assert "<<<<<<< " in text and "||||||| " in text and ">>>>>>> " in text  # diff3: the old release shown too
    with pytest.raises(authoring.AuthoringError, match="conflict markers .* are left in .*network.py"):
        authoring.refresh("twenty")
    assert not (patchsets_dir / "twenty" / NEXT).exists()

    for rel in conflicted:  # resolve as a person would: keep 0.5.17's code, add the change at the end
        lines, keep, out = (tree / rel).read_text().splitlines(keepends=True), True, []
        for line in lines:
            if line.startswith(("||||||| ", "=======")):
                keep = False
            elif line.startswith(">>>>>>> "):
                keep = True
            elif not line.startswith("<<<<<<< ") and keep:
                out.append(line)
        out.append(f"\n# synthetic twenty: {rel.rsplit('/', 1)[1]}\n")
        (tree / rel).write_text("".join(out))
    refreshed = authoring.refresh("twenty")
    assert refreshed.patch == patchsets_dir / "twenty" / NEXT / "0001-twenty.patch" and refreshed.files == 20
    assert patching.check("twenty", version=NEXT).ok
    assert patching.load_patchsets()["twenty"].versions == [VERSION, NEXT]


def test_a_hunk_git_merges_although_its_lines_changed_is_never_written_silently(release_cache, patchsets_dir):
    result = porting.port("three", NEXT)
    runai = "sglang/srt/utils/runai_utils.py"
    assert statuses(result)[runai] == ("conflicted", 0)
    assert not result.clean and result.markers == [] and result.review == [runai]
    assert "review" in next(h.detail for h in result.hunks if h.path == runai)
    assert not (patchsets_dir / "three" / NEXT).exists()
    merged = (result.tree / runai).read_text()
    assert "# synthetic three" in merged and "<<<<<<<" not in merged
    authoring.refresh("three")  # after review: the person takes git's merge
    assert patching.check("three", version=NEXT).ok


def test_port_refuses_what_it_cannot_do_and_writes_nothing(release_cache, patchsets_dir):
    with pytest.raises(porting.PortError, match=f"requires pair-base, which has no diffs for {NEXT}: port it first:"
                                                f" `invoke patch port pair-base --to {NEXT}`"):
        porting.port("pair-top", NEXT)
    assert not authoring.edit_dir("pair-top").exists()
    with pytest.raises(porting.PortError, match="not a release name"):
        porting.port("one-file", "latest")
    with pytest.raises(porting.PortError, match=f"one-file already has diffs for {VERSION}"):
        porting.port("one-file", VERSION)
    base = porting.port("pair-base", NEXT)
    assert base.clean
    with pytest.raises(authoring.AuthoringError, match="already exists"):
        porting.port("pair-base", "0.5.17.post9")  # the edit tree is in the way (checked before any download)
    top = porting.port("pair-top", NEXT)
    assert top.clean and top.below == ["pair-base"] and patching.check("pair-top", version=NEXT).ok
    meta = json.loads((top.tree / ".git" / authoring.META_FILE).read_text())
    assert meta["version"] == NEXT and meta["ported_from"] == VERSION
    subjects = [c.summary for c in git.Repo(top.tree).iter_commits()]
    assert subjects[0] == f"pair-top on sglang {NEXT} (ported from {VERSION})"


def test_cli_port_that_conflicts_exits_1_with_the_next_steps(release_cache, patchsets_dir):
    code, _, err = patch_cli("port", "one-file")
    assert code == 2 and "needs --to RELEASE" in err
    code, out, _ = patch_cli("port", "twenty", "--to", NEXT)
    assert code == 1
    assert f"twenty NOT ported to {NEXT} (10 as is, 7 moved, 3 conflicted): nothing written to patchsets/" in out
    assert "conflict markers in the file" in out and "+22 lines" in out
    assert "invoke patch refresh twenty" in out and not (patchsets_dir / "twenty" / NEXT).exists()


@pytest.mark.slow
def test_provision_moves_a_host_between_releases_and_patchsets_follow(release_cache, patchsets_dir, sandbox_env,
                                                                     tmp_path, next_wheel):
    """`invoke provision --stack cpu-ref-0.5.17` and back with `--stack cpu-ref` (their sglang steps, real
    pip installs from the index), with the patch engine refusing and then serving each release."""
    import dataclasses

    from tests.provision.conftest import pip_env, sandbox_with_venv
    from toolkit.provision import facts, provision, stack

    host = sandbox_with_venv(tmp_path / "host" / "venv")
    stacks = {v: stack.load(name) for v, name in ((VERSION, "cpu-ref"), (NEXT, "cpu-ref-0.5.17"))}

    def move_to(version):
        only_sglang = dataclasses.replace(stacks[version], steps=(stacks[version].step("sglang"),))
        done = provision.provision(host, only_sglang, env=pip_env())
        assert not done.failed, [(s.name, s.status, s.tail) for s in done.steps]
        assert facts.gather(host, stacks[version]).version("sglang") == version
        return done

    move_to(VERSION)
    assert patching.apply(host, "one-file").changed == 1
    moved = move_to(NEXT)
    assert moved.reapply == "invoke patch revert --all --force --host sandbox && invoke patch apply one-file --host sandbox"
    with pytest.raises(patching.PatchRefused, match=f"port it with `invoke patch port one-file --to {NEXT}`"):
        patching.apply(host, "one-file")  # the stale state is cleared first, as provision said
    assert patching.revert(host, force=True).stack_after == []
    with pytest.raises(patching.PatchRefused, match=f"port it with `invoke patch port one-file --to {NEXT}`"):
        patching.apply(host, "one-file")
    assert porting.port("one-file", NEXT).clean
    assert patching.apply(host, "one-file").changed == 1 and patching.verify(host).ok
    site = next(Path(host.venv).glob("lib/python*/site-packages"))
    assert patching.revert(host).record_ok and sha256(site / AUTH) == next_wheel.record[AUTH]
    move_to(VERSION)
    assert patching.apply(host, "one-file").changed == 1 and patching.verify(host).ok


@pytest.mark.parametrize("stack_name, torch", [("gpu", "2.11.0"), ("gpu-0.5.17", "2.11.0"), ("gpu-0.5.23", "2.14.1")])
def test_each_gpu_stack_pins_what_its_sglang_wheel_requires(stack_name, torch):
    """torch, sglang-kernel and flashinfer-python as the release's own METADATA pins them (the stack adds
    the CUDA build label to torch), and a stack Python its wheel accepts. torch 2.11.0 is the GPU
    machine's image, so 0.5.11 and 0.5.17 can run there; 0.5.23 needs torch 2.14.1."""
    from toolkit.provision import stack
    from toolkit.patch import wheels

    loaded = stack.load(stack_name)
    pins = {p.name: p for p in loaded.pins}
    wheel = wheels.pristine("sglang", pins["sglang"].version)
    metadata = wheel.read(f"{wheel.dist_info}/METADATA").decode()
    required = dict(re.findall(r"^Requires-Dist: ([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?==([^\s;]+)\s*$", metadata, re.M))
    required = {stack.normalize(k): v for k, v in required.items()}
    assert pins["torch"].version == required["torch"] + "+cu130" == torch + "+cu130"
    for name in ("sglang-kernel", "flashinfer-python"):
        assert pins[name].version == required[name], name
    oldest = re.search(r"^Requires-Python: >=(\d+\.\d+)\s*$", metadata, re.M).group(1)
    assert loaded.python_ok(oldest) and loaded.python == oldest, (loaded.python, oldest)


@pytest.mark.parametrize("cpu, gpu", [("cpu-ref", "gpu"), ("cpu-ref-0.5.17", "gpu-0.5.17"),
                                      ("cpu-ref-0.5.23", "gpu-0.5.23")])
def test_each_cpu_reference_stack_holds_its_gpu_stacks_release(cpu, gpu):
    """The sandbox's stack of a release patches the same SGLang and reads the same FlashInfer (the sm120
    gate's trtllm_comm majors) as that release's GPU stack, on a Python the release accepts."""
    from toolkit.provision import stack

    cpu_stack, gpu_stack = stack.load(cpu), stack.load(gpu)
    cpu_pins, gpu_pins = ({p.name: p.version for p in s.pins} for s in (cpu_stack, gpu_stack))
    assert cpu_pins["sglang"] == gpu_pins["sglang"] and cpu_pins["flashinfer-python"] == gpu_pins["flashinfer-python"]
    assert cpu_stack.python == gpu_stack.python

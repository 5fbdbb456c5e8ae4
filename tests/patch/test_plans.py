"""What apply and revert decide (toolkit/patch/patchplan.py), from probe answers written out here: no
host, no sshd, no wheel download. The probe dicts have the shape `patchhost.probe` returns; the
images and the wheel are small stand-ins with the fields the plans read. The real runs over sshd
are tests/patch/test_host.py, test_faults.py and their neighbours."""
from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from toolkit.patch import compiler, patchplan, patchsets
from toolkit.patch.patchhost import PatchRefused

A, B, NEW = "sglang/a.py", "sglang/b.py", "sglang/new.py"
HOST = "h1"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


PRISTINE = {A: b"a = 1\n", B: b"b = 1\n"}
BY_LOW = {A: b"a = 2\n"}                       # "low" patches a.py
BY_TOP = {A: b"a = 3\n", NEW: b"new = 1\n"}    # "top" (requires low) patches a.py again and adds new.py


class Wheel:
    path = Path("sglang-0.5.11-py3-none-any.whl")

    def __init__(self, files=PRISTINE):
        self.files = dict(files)
        self.record = {p: sha(b) for p, b in self.files.items()}

    def has(self, path):
        return path in self.record

    def read(self, path):
        return self.files[path]


def diff_adding(path: str) -> str:
    return (f"diff --git a/{path} b/{path}\nnew file mode 100644\n--- /dev/null\n+++ b/{path}\n"
            f"@@ -0,0 +1 @@\n+x = 1\n")


@pytest.fixture
def known(tmp_path):
    """low (order 10), top (order 20, requires low), other (order 30), each with a 0.5.11 diff."""
    for name, order, requires in (("low", 10, []), ("top", 20, ["low"]), ("other", 30, [])):
        (tmp_path / name / "0.5.11").mkdir(parents=True)
        (tmp_path / name / "0.5.11" / "0001.patch").write_text(diff_adding(f"sglang/{name}_marker.py"))
        (tmp_path / name / "patchset.toml").write_text(
            f'name = "{name}"\nsummary = "s"\npackage = "sglang"\norder = {order}\nrequires = {requires!r}\n'
            .replace("'", '"'))
    return patchsets.load_all(tmp_path)


def image(stack: list[str]) -> compiler.Image:
    files = {}
    for name, layer in (("low", BY_LOW), ("top", BY_TOP)):
        if name in stack:
            for p, data in layer.items():
                files[p] = compiler.FileImage(p, sha(PRISTINE[p]) if p in PRISTINE else None, sha(data), data, name)
    return compiler.Image("sglang", "0.5.11", list(stack), files)


def state_for(stack: list[str], known, **extra) -> dict:
    state = patchplan.new_state(image(stack), known, "/site")
    state.update(extra)
    return state


def probe(files=None, state=None, version="0.5.11", **extra) -> dict:
    found = {p: sha(b) for p, b in PRISTINE.items()}
    found[NEW] = None
    found.update(files or {})
    answer = {"version": version, "site": "/site", "files": found, "record": {p: sha(b) for p, b in PRISTINE.items()},
              "state": state, "state_sha": None, "backups": {}, "sizes": {}, "blocked": {}, "space": None,
              "recovered": None, "backup_dir": "/state/backups"}
    answer.update(extra)
    return answer


# -- apply ------------------------------------------------------------------------------

def test_apply_on_a_pristine_host_writes_the_image_and_records_the_stack(known):
    plan = patchplan.plan_apply("low", known, probe(), image(["low"]), Wheel(), HOST)
    assert (plan.stack_before, plan.stack_after) == ([], ["low"])
    assert [(w["path"], w["sha256"]) for w in plan.writes] == [(A, sha(BY_LOW[A]))]
    assert plan.sizes == [len(BY_LOW[A])]
    assert [(r.path, r.status, r.by) for r in plan.rows] == [(A, "changed", "low")]
    assert [e["name"] for e in plan.new_state["stack"]] == ["low"]
    assert plan.new_state["files"][A] == {"pristine": sha(PRISTINE[A]), "expected": sha(BY_LOW[A]), "by": "low"}
    assert not plan.drifted and not plan.nothing_to_do


def test_apply_on_top_keeps_what_is_below_and_creates_new_files(known):
    host = probe({A: sha(BY_LOW[A])}, state_for(["low"], known))
    plan = patchplan.plan_apply("top", known, host, image(["low", "top"]), Wheel(), HOST, dry_run=True)
    assert plan.stack_after == ["low", "top"]
    assert {r.path: r.status for r in plan.rows} == {A: "would change", NEW: "would change"}
    assert {w["path"] for w in plan.writes} == {A, NEW}


def test_apply_again_is_nothing_to_do(known):
    host = probe({A: sha(BY_LOW[A])}, state_for(["low"], known))
    plan = patchplan.plan_apply("low", known, host, image(["low"]), Wheel(), HOST)
    assert plan.nothing_to_do and plan.writes == []
    assert [r.status for r in plan.rows] == ["unchanged"]


def test_a_hand_edit_is_drift_and_nothing_else_is_decided(known):
    plan = patchplan.plan_apply("low", known, probe({A: sha(b"edited\n")}), image(["low"]), Wheel(), HOST)
    assert plan.drifted == [A] and plan.new_state == {}


@pytest.mark.parametrize("host, name, refusal", [
    (probe(version=None), "low", "sglang is not installed in /site on h1"),
    (probe(version="0.5.17"), "low", "h1 has sglang 0.5.17: low has no diff for sglang 0.5.17"),
    (probe(), "top", "top requires low, not applied on h1; run `invoke patch apply low --host h1` first"),
])
def test_apply_refuses_before_any_file_is_looked_at(known, host, name, refusal):
    with pytest.raises(PatchRefused, match="nothing written") as caught:
        patchplan.apply_stack(name, known, host, HOST)
    assert refusal in str(caught.value)


def test_apply_refuses_a_state_for_another_release_an_unknown_patchset_and_damage(known):
    stale = probe(state=state_for(["low"], known, version="0.5.9"))
    with pytest.raises(PatchRefused, match="records sglang 0.5.9 but 0.5.11 is installed"):
        patchplan.apply_stack("other", known, stale, HOST)
    unknown = probe(state={"version": "0.5.11", "stack": [{"name": "gone"}], "files": {}})
    with pytest.raises(PatchRefused, match="h1 has gone applied, which is not in patchsets/"):
        patchplan.apply_stack("other", known, unknown, HOST)
    damaged = probe(state=state_for(["low"], known, damaged=[A]))
    with pytest.raises(PatchRefused, match=f"a cut run left {A} damaged on h1"):
        patchplan.apply_stack("other", known, damaged, HOST)


def test_apply_refuses_a_record_of_another_build(known):
    host = probe(record={A: sha(b"other build\n"), B: sha(PRISTINE[B])})
    with pytest.raises(PatchRefused, match=f"the installed RECORD hash of {A} differs"):
        patchplan.plan_apply("low", known, host, image(["low"]), Wheel(), HOST)


def test_apply_refuses_a_file_it_cannot_replace_and_a_state_it_cannot_write(known):
    with pytest.raises(PatchRefused, match=f"cannot replace 1 file\\(s\\) on h1; nothing written:\n  {A}: read-only"):
        patchplan.plan_apply("low", known, probe(blocked={A: "read-only"}), image(["low"]), Wheel(), HOST)
    # a blocked file the run does not write is no reason to refuse
    assert patchplan.plan_apply("low", known, probe(blocked={B: "read-only"}), image(["low"]), Wheel(), HOST).writes
    with pytest.raises(PatchRefused, match="h1: state dir is read-only; nothing written"):
        patchplan.plan_apply("low", known, probe(state_blocked="state dir is read-only"), image(["low"]), Wheel(), HOST)


def test_apply_refuses_when_a_file_system_is_short_of_space(known):
    site = {"dev": 1, "free": 10 ** 9, "block": 4096, "path": "/site"}
    roomy = probe(space={"site": site, "state": {"dev": 2, "free": 10 ** 9, "block": 4096, "path": "/st"}})
    assert patchplan.plan_apply("low", known, roomy, image(["low"]), Wheel(), HOST).writes
    # the state folder takes the backup, the journal and the state: one block each at least
    full = probe(space={"site": site, "state": {"dev": 2, "free": 4096, "block": 4096, "path": "/st"}})
    with pytest.raises(PatchRefused, match="not enough free space on h1; nothing written: /st has 4096 bytes free"):
        patchplan.plan_apply("low", known, full, image(["low"]), Wheel(), HOST)


# -- revert -----------------------------------------------------------------------------

def test_revert_kinds(known):
    assert patchplan.revert_target("low", known, probe(), HOST).kind == "not applied"
    assert patchplan.revert_target(None, known, probe(), HOST).kind == "nothing"
    applied = probe({A: sha(BY_TOP[A]), NEW: sha(BY_TOP[NEW])}, state_for(["low", "top"], known))
    target = patchplan.revert_target("top", known, applied, HOST)
    assert (target.kind, target.keep, target.version) == ("pop", ["low"], "0.5.11")
    assert patchplan.revert_target(None, known, applied, HOST).keep == []
    assert patchplan.revert_target("low", known, applied, HOST).keep == []   # low and top above it


def test_revert_refusals(known):
    with pytest.raises(patchsets.PatchsetError, match="unknown patchset 'nope'"):
        patchplan.revert_target("nope", known, probe(), HOST)
    damaged = probe(state=state_for(["low"], known, damaged=[A]))
    with pytest.raises(PatchRefused, match="other is not applied on h1 \\(applied: low\\)"):
        patchplan.revert_target("other", known, damaged, HOST)
    stale = probe(state=state_for(["low"], known, version="0.5.9"))
    with pytest.raises(PatchRefused, match="revert --all --force --host h1` to clear the stale state"):
        patchplan.revert_target(None, known, stale, HOST)
    assert patchplan.revert_target(None, known, stale, HOST, force=True).kind == "stale state"
    gone = probe(state={"version": "0.5.11", "stack": [{"name": "gone"}, {"name": "low"}], "files": {}})
    with pytest.raises(PatchRefused, match="cannot rebuild gone"):
        patchplan.revert_target("low", known, gone, HOST)


def applied_top(known, edited=None, **extra):
    return probe({A: sha(BY_TOP[A]), NEW: sha(BY_TOP[NEW]), **(edited or {})}, state_for(["low", "top"], known),
                 **extra)


def test_revert_pops_to_the_image_below_using_backups_where_they_are_good(known):
    host = applied_top(known, backups={sha(BY_LOW[A]): "ok"})
    target = patchplan.revert_target("top", known, host, HOST)
    plan = patchplan.plan_revert(target, known, host, image(["low"]), Wheel(), HOST)
    writes = {w["path"]: w for w in plan.writes}
    assert writes[A]["from_backup"] == sha(BY_LOW[A]) and writes[A]["content"] is None
    assert writes[NEW]["sha256"] is None                         # the file top created goes away
    assert [e["name"] for e in plan.new_state["stack"]] == ["low"]
    assert {r.path: (r.status, r.by) for r in plan.rows} == {A: ("changed", "low"), NEW: ("changed", None)}


def test_revert_all_restores_from_the_wheel_when_a_backup_is_bad(known):
    host = applied_top(known, backups={sha(PRISTINE[A]): "corrupt"})
    target = patchplan.revert_target(None, known, host, HOST)
    plan = patchplan.plan_revert(target, known, host, image([]), Wheel(), HOST, dry_run=True)
    assert plan.new_state == patchplan.empty_state("sglang", "0.5.11", "/site")
    assert f"backup of {A} is corrupt: using the pristine file from the wheel" in plan.notes
    assert {r.status for r in plan.rows} == {"would change"}


def test_revert_refuses_hand_edits_unless_forced(known):
    host = applied_top(known, {A: sha(b"edited\n")})
    target = patchplan.revert_target(None, known, host, HOST)
    assert patchplan.plan_revert(target, known, host, image([]), Wheel(), HOST).drifted == [A]
    forced = patchplan.plan_revert(target, known, host, image([]), Wheel(), HOST, force=True)
    assert forced.overwritten == [A] and not forced.drifted
    assert next(r for r in forced.rows if r.path == A).detail == "overwriting a hand edit (--force)"


def test_a_damaged_file_is_drift_even_when_it_holds_the_target(known):
    host = applied_top(known)
    host["state"]["damaged"] = [B]
    target = patchplan.revert_target(None, known, host, HOST)
    assert patchplan.plan_revert(target, known, host, image([]), Wheel(), HOST).drifted == [B]
    forced = patchplan.plan_revert(target, known, host, image([]), Wheel(), HOST, force=True)
    assert B in {w["path"] for w in forced.writes} and B not in forced.overwritten


def test_not_applied_names_files_that_hold_neither_pristine_nor_the_image(known):
    clean = probe({A: sha(BY_LOW[A])}, state_for(["low"], known))
    assert patchplan.not_applied_differ(clean) == []
    edited = probe({A: sha(BY_LOW[A]), B: sha(b"edited\n")}, state_for(["low"], known))
    assert patchplan.not_applied_differ(edited) == [B]

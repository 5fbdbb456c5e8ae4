"""apply / verify / revert against the real sshd on loopback and the real SGLang 0.5.11 files."""
import json
from pathlib import Path

import pytest

from toolkit.patch import patching
from toolkit.patch.patchsets import PatchsetError

from .conftest import sha256

AUTH = "sglang/srt/utils/auth.py"
JSON_RESPONSE = "sglang/srt/utils/json_response.py"
NETWORK = "sglang/srt/utils/network.py"


def state_dir(host) -> Path:
    return Path(host.toolkit_state_dir) / "patch"


def test_apply_writes_the_image_reapply_is_a_noop_and_revert_restores_record(host, site, patchsets_dir,
                                                                               sglang_wheel):
    pyc = list((site / "sglang/srt/utils/__pycache__").glob("auth.*.pyc"))
    assert pyc, "pip byte-compiled the package"
    result = patching.apply(host, "one-file")
    assert result.changed == 1 and result.round_trips == 2
    assert "error_status_code: int = 403" in (site / AUTH).read_text()
    assert not any(p.exists() for p in pyc), "stale __pycache__ entry of the changed module removed"
    assert sha256(site / AUTH) != sglang_wheel.record[AUTH]

    again = patching.apply(host, "one-file")
    assert again.changed == 0 and again.round_trips == 1

    verdict = patching.verify(host)
    assert verdict.ok and verdict.round_trips == 1
    assert {f.path: (f.status, f.by) for f in verdict.files}[AUTH] == ("patched", "one-file")

    undone = patching.revert(host)
    assert undone.changed == 1 and undone.record_ok and undone.round_trips == 2
    assert sha256(site / AUTH) == sglang_wheel.record[AUTH]
    assert patching.verify(host, all_files=True).ok


def test_stack_follows_requires_and_order_and_revert_pops_down_to_name(host, site, patchsets_dir, sglang_wheel):
    with pytest.raises(patching.PatchRefused, match="run `invoke patch apply pair-base --host sandbox` first"):
        patching.apply(host, "pair-top")
    assert not state_dir(host).exists(), "refusal wrote nothing"
    patching.apply(host, "twenty")
    patching.apply(host, "pair-base")
    top = patching.apply(host, "pair-top")
    assert top.stack_after == ["pair-base", "pair-top", "twenty"]
    assert "PAIR_LEVEL = 'top'" in (site / JSON_RESPONSE).read_text()
    planned = patching.revert(host, "pair-top", dry_run=True)
    assert planned.popped == ["twenty", "pair-top"] and planned.stack_after == ["pair-base"]
    popped = patching.revert(host, "pair-top")
    assert popped.stack_after == ["pair-base"] and popped.popped == ["twenty", "pair-top"]
    assert "PAIR_LEVEL = 'base'" in (site / JSON_RESPONSE).read_text()
    assert sha256(site / NETWORK) == sglang_wheel.record[NETWORK]
    state = json.loads((state_dir(host) / "state.json").read_text())
    assert [s["name"] for s in state["stack"]] == ["pair-base"]
    assert patching.verify(host).ok


def test_twenty_files_cost_the_same_round_trips(host, patchsets_dir):
    assert patching.apply(host, "twenty").round_trips == 2
    assert patching.verify(host, all_files=True).round_trips == 1
    assert patching.revert(host).round_trips == 2


def test_hand_edit_fails_verify_and_apply_refuses_with_a_diff(host, site, patchsets_dir):
    patching.apply(host, "twenty")
    with open(site / NETWORK, "a") as f:
        f.write("HAND_EDIT = 1\n")
    verdict = patching.verify(host)
    assert not verdict.ok
    assert [(f.path, f.status) for f in verdict.files if f.status != "patched"
            and f.status != "pristine"] == [(NETWORK, "drifted")]
    before = sha256(site / AUTH)
    with pytest.raises(patching.PatchRefused) as refused:
        patching.apply(host, "one-file")
    assert NETWORK in refused.value.reason and "nothing written" in refused.value.reason
    assert "+HAND_EDIT = 1" in refused.value.diff and "(image of twenty)" in refused.value.diff
    assert sha256(site / AUTH) == before
    with pytest.raises(patching.PatchRefused, match="--force") as refused:
        patching.revert(host)
    assert "+HAND_EDIT = 1" in refused.value.diff and "(image of twenty)" in refused.value.diff
    edited = (site / NETWORK).read_bytes()
    planned = patching.revert(host, force=True, dry_run=True)
    assert any(n.startswith(f"{NETWORK}: the hand-edited bytes would be kept in ") for n in planned.notes)
    forced = patching.revert(host, force=True)
    assert forced.record_ok and patching.verify(host, all_files=True).ok
    kept = [n for n in forced.notes if n.startswith(f"{NETWORK}: the hand-edited bytes are kept in ")]
    assert len(kept) == 1
    backup = Path(kept[0].split(" are kept in ", 1)[1].rsplit(" on ", 1)[0])
    assert backup.parent == state_dir(host) / "backups" and backup.read_bytes() == edited


def test_hand_edit_of_an_unpatched_file_is_drift_too(host, site, patchsets_dir):
    with open(site / AUTH, "a") as f:
        f.write("# local change\n")
    with pytest.raises(patching.PatchRefused) as refused:
        patching.apply(host, "one-file")
    assert "(pristine)" in refused.value.diff and "+# local change" in refused.value.diff
    assert not patching.verify(host).ok


def test_wrong_installed_version_is_refused_with_nothing_written(host, site, patchsets_dir):
    metadata = next(site.glob("sglang-*.dist-info")) / "METADATA"
    metadata.write_text(metadata.read_text().replace("Version: 0.5.11", "Version: 0.5.10", 1))
    before = sha256(site / AUTH)
    with pytest.raises(patching.PatchRefused) as refused:
        patching.apply(host, "one-file")
    assert refused.value.reason == ("sandbox has sglang 0.5.10: one-file has no diff for sglang 0.5.10 (it has: 0.5.11);"
                                    " port it with `invoke patch port one-file --to 0.5.10`; nothing written")
    assert sha256(site / AUTH) == before and not state_dir(host).exists()


def test_corrupt_backup_falls_back_to_the_wheel(host, site, patchsets_dir, sglang_wheel):
    patching.apply(host, "twenty")
    backup = state_dir(host) / "backups" / sglang_wheel.record[NETWORK]
    backup.write_bytes(b"bit rot")
    (state_dir(host) / "backups" / sglang_wheel.record["sglang/srt/utils/offloader.py"]).unlink()
    undone = patching.revert(host)
    assert undone.record_ok
    assert any(f"backup of {NETWORK} is corrupt: using the pristine file from the wheel" in n for n in undone.notes)
    assert any("offloader.py is missing" in n for n in undone.notes)
    assert sha256(site / NETWORK) == sglang_wheel.record[NETWORK]
    assert patching.verify(host, all_files=True).ok


def test_dry_run_writes_nothing(host, site, patchsets_dir):
    planned = patching.apply(host, "twenty", dry_run=True)
    assert planned.changed == 20 and {f.status for f in planned.files} == {"would change"}
    assert not state_dir(host).exists()
    patching.apply(host, "twenty")
    before = sha256(site / NETWORK)
    planned = patching.revert(host, dry_run=True)
    assert planned.changed == 20 and sha256(site / NETWORK) == before


def test_changed_patch_file_updates_the_host_on_reapply(host, site, patchsets_dir):
    patching.apply(host, "one-file")
    patch = patchsets_dir / "one-file" / "0.5.11" / "0001-one-file.patch"
    patch.write_text(patch.read_text().replace("403  # synthetic one-file", "404  # synthetic one-file"))
    assert patching.apply(host, "one-file").changed == 1
    assert "int = 404" in (site / AUTH).read_text()
    assert patching.verify(host).ok


def test_conflicting_patchset_is_refused_before_the_host_is_touched(host, site, patchsets_dir):
    patching.apply(host, "one-file")
    state_before = (state_dir(host) / "state.json").read_bytes()
    with pytest.raises(Exception, match="does not apply on top of pristine \\+ one-file"):
        patching.apply(host, "clash")
    assert (state_dir(host) / "state.json").read_bytes() == state_before


def test_unknown_patchset_and_bare_site_dir(host, host_venv, site, patchsets_dir):
    with pytest.raises(PatchsetError, match="unknown patchset 'nope'"):
        patching.apply(host, "nope")
    import dataclasses

    bare = dataclasses.replace(host, venv=None, pythonpath=str(site), state_dir=str(host_venv / "state"))
    assert patching.apply(bare, "one-file").changed == 1
    assert patching.verify(bare).ok and (host_venv / "state" / "patch" / "state.json").exists()


def test_local_host_without_ssh(host_venv, site, patchsets_dir, sglang_wheel):
    from toolkit.core.inventory import Host

    local = Host(name="local", transport="local", venv=str(host_venv))
    applied = patching.apply(local, "three")
    assert applied.changed == 3 and applied.round_trips == 2
    assert patching.verify(local).ok
    assert patching.revert(local).record_ok
    assert all(sha256(site / p) == sglang_wheel.record[p] for p in patching.load_patchsets()["three"].touched())


def test_reinstalled_other_version_with_a_stale_state(host, site, patchsets_dir):
    patching.apply(host, "one-file")
    metadata = next(site.glob("sglang-*.dist-info")) / "METADATA"
    metadata.write_text(metadata.read_text().replace("Version: 0.5.11", "Version: 0.5.12", 1))
    assert not patching.verify(host).ok
    with pytest.raises(patching.PatchRefused, match="revert --all --force"):
        patching.revert(host)
    cleared = patching.revert(host, force=True)
    assert cleared.stack_after == [] and patching.verify(host).stack == []

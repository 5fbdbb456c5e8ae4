"""`invoke patch ...` as the user types it: through Invoke's Program in a subprocess, real sshd."""
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers import invoke
from .conftest import sha256

ROOT = Path(__file__).resolve().parents[2]
NETWORK = "sglang/srt/utils/network.py"


def patch_cli(*args, env_extra=None):
    done = invoke("patch", *args, env=env_extra, columns=200)
    return done.returncode, done.stdout, done.stderr


@pytest.fixture
def two_hosts(inventory, base_venv, tmp_path, patchsets_dir):
    venvs = []
    for i in (1, 2):
        copy = tmp_path / f"v{i}"
        subprocess.run(["cp", "-al", str(base_venv), str(copy)], check=True)
        venvs.append(copy)
    yield inventory(*venvs), venvs
    for venv in venvs:
        shutil.rmtree(venv, ignore_errors=True)


def test_help_list_and_check(patchsets_dir):
    code, out, _ = patch_cli("--help")
    assert code == 0 and "revert [NAME|--all]" in out
    code, out, _ = patch_cli("list")
    assert code == 0 and "pair-top" in out and "pair-base" in out
    code, out, _ = patch_cli("check", "pair-top")
    assert code == 0, out
    assert "ok: pair-base + pair-top compiles against 0.5.11: 2 files, 3 hunks, +5 -1 lines" in out
    code, out, err = patch_cli("check")
    assert code == 1 and "does not apply on top of pristine + one-file" in err
    code, _, err = patch_cli("frobnicate")
    assert code == 2 and "unknown action" in err
    code, _, err = patch_cli("apply")
    assert code == 2 and "needs a patchset name" in err


def test_apply_verify_revert_on_two_hosts(two_hosts, sglang_wheel):
    (first, second), venvs = two_hosts
    hosts = f"{first},{second}"
    code, out, err = patch_cli("apply", "twenty", "--host", hosts)
    assert code == 0, err
    assert f"{first}: 20 changed; stack twenty (2 round trips)" in out
    assert f"{second}: 20 changed" in out and "probing" in err
    code, out, _ = patch_cli("apply", "twenty", "--host", hosts)
    assert code == 0 and f"{first}: 0 changed" in out and f"{second}: 0 changed" in out

    code, out, _ = patch_cli("verify", "--host", hosts, "--json")
    rows = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and [r["host"] for r in rows] == [first, second] and all(r["ok"] for r in rows)
    assert {f["status"] for f in rows[0]["files"] if f["path"] == NETWORK} == {"patched"}

    site = next(venvs[1].glob("lib/python*/site-packages"))
    (site / NETWORK).unlink()
    (site / NETWORK).write_text("edited by hand\n")  # a new inode: the base venv stays intact
    code, out, _ = patch_cli("verify", "--host", hosts)
    assert code == 1 and f"{first}: matches its recorded state" in out
    assert f"{second}: DOES NOT match" in out and "drifted" in out

    code, out, err = patch_cli("apply", "one-file", "--host", second)
    assert code == 1 and "changed by hand" in err and "+edited by hand" in err

    code, out, err = patch_cli("revert", "--host", second)
    assert code == 1 and "--force" in err and "+edited by hand" in err
    code, out, err = patch_cli("revert", "--host", hosts, "--force", "--dry-run")
    assert code == 0 and "20 would change" in out and sha256(site / NETWORK) != sglang_wheel.record[NETWORK]
    assert "dry run: nothing written" in out and "match RECORD" not in out
    assert "the hand-edited bytes would be kept in" in err
    code, out, err = patch_cli("revert", "--all", "--host", hosts, "--force")
    assert code == 0, err
    assert "stack now nothing (pristine); restored files match RECORD" in out
    assert f"{NETWORK}: the hand-edited bytes are kept in " in err
    assert sha256(site / NETWORK) == sglang_wheel.record[NETWORK]
    code, out, _ = patch_cli("verify", "--all-files", "--host", hosts)
    assert code == 0 and "RECORD files checked" in out


def test_unreachable_and_unknown_hosts_fail_clearly(two_hosts):
    code, _, err = patch_cli("verify", "--host", "nosuchhost")
    assert code == 2 and "unknown host 'nosuchhost'" in err


def test_revert_name_says_which_patchsets_above_it_go_too(inventory, host_venv, patchsets_dir):
    (name,) = inventory(host_venv)
    for patchset in ("pair-base", "pair-top", "twenty"):
        code, _, err = patch_cli("apply", patchset, "--host", name)
        assert code == 0, err
    code, out, _ = patch_cli("revert", "pair-top", "--host", name, "--dry-run")
    assert code == 0
    assert f"{name}: 22 would change; would pop twenty, pair-top (twenty stacked above pair-top);" \
           f" stack would be pair-base" in out and "RECORD" not in out
    code, out, _ = patch_cli("revert", "pair-top", "--host", name)
    assert code == 0
    assert f"{name}: 22 changed; popped twenty, pair-top (twenty stacked above pair-top); stack now pair-base;" \
           f" restored files match RECORD" in out


def test_revert_is_repeatable_and_an_unknown_name_is_an_error(inventory, host_venv, patchsets_dir, sglang_wheel):
    (name,) = inventory(host_venv)
    site = next(host_venv.glob("lib/python*/site-packages"))
    code, out, err = patch_cli("revert", "no-such-patchset", "--host", name)
    assert code == 1 and "unknown patchset 'no-such-patchset'; known: clash, one-file, pair-base" in err, out + err
    code, out, err = patch_cli("revert", "twenty", "--host", name)  # pristine host: the goal holds already
    assert code == 0 and f"{name}: twenty is not applied: nothing to do" in err, out + err
    for step in (("apply", "pair-base"), ("apply", "twenty"), ("revert", "twenty"), ("revert", "twenty")):
        code, out, err = patch_cli(*step, "--host", name)
        assert code == 0, out + err
    assert f"{name}: twenty is not applied: nothing to do" in err and f"{name}: 0 changed" in out
    assert sha256(site / NETWORK) == sglang_wheel.record[NETWORK]
    code, out, err = patch_cli("revert", "no-such-patchset", "--host", name)
    assert code == 1 and "unknown patchset 'no-such-patchset'" in err
    edited = site / "sglang/srt/utils/offloader.py"   # one of twenty's files, changed by hand
    edited.write_text(edited.read_text() + "# hand edit\n")
    code, out, err = patch_cli("revert", "twenty", "--host", name)
    assert code == 1 and "twenty is not applied on" in err and "sglang/srt/utils/offloader.py holds neither" in err
    assert edited.read_text().endswith("# hand edit\n")


def _advised(text: str, start: str) -> list[str]:
    """The command in backquotes that starts with `start`, as a user would paste it."""
    found = re.search(r"`(" + re.escape(start) + r"[^`]*)`", text)
    assert found, text
    return found.group(1).split()


def test_unknown_patchsets_and_release_names_are_bad_input(patchsets_dir):
    """Exit 2, as an unknown host or profile: nothing is probed or downloaded."""
    for args in (("apply", "nosuch"), ("check", "nosuch"), ("port", "nosuch", "--to", "0.5.17")):
        code, _, err = patch_cli(*args, "--host", "nosuchhost-either")
        assert code == 2 and "unknown patchset 'nosuch'; known: clash, one-file" in err, (args, err)
    for args, option in ((("port", "pair-top", "--to", "abc"), "--to 'abc'"),
                         (("port", "pair-top", "--to", "0.5.17", "--from", "x"), "--from 'x'"),
                         (("check", "pair-top", "--release", "latest"), "--release 'latest'")):
        code, _, err = patch_cli(*args)
        assert code == 2 and f"{option} is not a release name like 0.5.17" in err, err


def test_after_a_hand_edit_verify_and_apply_name_a_command_that_works_pasted(inventory, host_venv, patchsets_dir,
                                                                              sglang_wheel):
    (name,) = inventory(host_venv)
    site = next(host_venv.glob("lib/python*/site-packages"))
    code, _, err = patch_cli("apply", "twenty", "--host", name)
    assert code == 0, err
    (site / NETWORK).write_text((site / NETWORK).read_text() + "# edited by hand\n")   # a private copy
    code, out, _ = patch_cli("verify", "--host", name)
    assert code == 1 and f"{name}: DOES NOT match its recorded state" in out
    advice = _advised(out, "invoke patch revert")
    assert advice == ["invoke", "patch", "revert", "--force", "--host", name]
    code, out, err = patch_cli("apply", "one-file", "--host", name)
    assert code == 1 and "changed by hand" in err and _advised(err, "invoke patch revert") == advice
    done = invoke(*advice[1:], columns=200)
    assert done.returncode == 0, done.stdout + done.stderr
    assert sha256(site / NETWORK) == sglang_wheel.record[NETWORK]
    code, out, _ = patch_cli("verify", "--host", name)
    assert code == 0 and "to put the files back" not in out
    code, _, err = patch_cli("apply", "twenty", "--host", name)
    assert code == 0, err


def test_the_edit_advice_of_port_works_pasted(patchsets_dir, sglang_wheel, tmp_path):
    cache = tmp_path / "cache"
    (cache / "wheels").mkdir(parents=True)
    (cache / "wheels" / sglang_wheel.path.name).symlink_to(sglang_wheel.path)
    env = {"TOOLKIT_CACHE": str(cache)}
    code, _, err = patch_cli("port", "pair-top", "--to", "0.5.11", env_extra=env)
    assert code == 1 and "pair-top already has diffs for 0.5.11" in err, err
    advice = _advised(err, "invoke patch edit")
    assert advice == ["invoke", "patch", "edit", "pair-top", "--release", "0.5.11"]
    done = invoke(*advice[1:], env=env, columns=200)
    assert done.returncode == 0 and "edit tree for pair-top" in done.stdout, done.stdout + done.stderr
    shutil.rmtree(cache, ignore_errors=True)


def test_an_empty_release_folder_names_a_command_that_works_pasted(patchsets_dir):
    (patchsets_dir / "one-file" / "0.5.99").mkdir()
    code, _, err = patch_cli("list")
    assert code == 1 and "one-file/0.5.99/ holds no .patch file" in err, err
    assert "invoke patch port one-file --to 0.5.99" in err and "--version" not in err
    done = subprocess.run(_advised(err, "rmdir"), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    code, out, _ = patch_cli("list")
    assert code == 0 and "one-file" in out


def test_apply_and_revert_with_json_print_one_object_per_host_and_nothing_else(inventory, host_venv, patchsets_dir):
    (name,) = inventory(host_venv)
    code, out, err = patch_cli("apply", "pair-base", "--host", name, "--json")
    assert code == 0, err
    applied = json.loads(out)   # stdout is the JSON line alone: no table, no notes
    assert applied["host"] == name and applied["stack_after"] == ["pair-base"] and applied["changed"] >= 1
    assert applied["server_loaded_before"] is None and not applied["dry_run"]
    code, out, err = patch_cli("revert", "--host", name, "--json", "--dry-run")
    assert code == 0, err
    planned = json.loads(out)
    assert planned["dry_run"] and planned["popped"] == ["pair-base"] and planned["stack_after"] == []
    code, out, err = patch_cli("revert", "--host", name, "--json")
    reverted = json.loads(out)
    assert code == 0 and reverted["record_ok"] and reverted["stack_after"] == [] and reverted["changed"] >= 1


def test_list_and_verify_refuse_a_name_they_would_ignore():
    for action in ("list", "verify"):
        code, _, err = patch_cli(action, "sm120")
        assert code == 2 and f"`invoke patch {action}` takes no patchset name (got 'sm120')" in err

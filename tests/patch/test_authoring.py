"""edit / refresh: a git work tree of the pristine release with the stack as commits, diff exported back."""
import os
import shutil
import tomllib

import git
import pytest

from toolkit.patch import authoring, patching, wheels

from .conftest import sha256


@pytest.fixture
def cache(tmp_path, monkeypatch, sglang_wheel):
    """A private cache (edit trees, images) that reuses the downloaded wheel."""
    folder = tmp_path / "cache"
    (folder / "wheels").mkdir(parents=True)
    os.symlink(sglang_wheel.path, folder / "wheels" / sglang_wheel.path.name)
    monkeypatch.setenv("TOOLKIT_CACHE", str(folder))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)  # edit trees hold the whole package


def test_edit_refresh_round_trip_with_a_new_file_then_apply_and_revert(cache, patchsets_dir, host, site):
    laid = authoring.edit("pair-top")
    repo = git.Repo(laid.tree)
    subjects = [c.summary for c in repo.iter_commits()][::-1]
    assert subjects[0] == "pristine sglang 0.5.11" and subjects[1].startswith("pair-base:")
    assert subjects[2].startswith("pair-top:") and laid.below == ["pair-base"]
    assert repo.tags["toolkit-base"].commit.summary.startswith("pair-base:")
    assert laid.files > 1000 and (laid.tree / "sglang/srt/layers/communicator.py").exists()

    target = laid.tree / "sglang/srt/utils/json_response.py"
    target.write_text(target.read_text().replace("PAIR_LEVEL = 'top'", "PAIR_LEVEL = 'edited'"))
    (laid.tree / "sglang/srt/utils/new_helper.py").write_text("HELPER = True\n")
    with pytest.raises(authoring.AuthoringError, match="already exists"):
        authoring.edit("pair-top")

    result = authoring.refresh("pair-top")
    text = (patchsets_dir / "pair-top" / "0.5.11" / "0001-pair-top.patch").read_text()
    assert "+PAIR_LEVEL = 'edited'" in text and "-PAIR_LEVEL = 'base'" in text
    assert "new file mode" in text and result.files == 3 and not result.wrote_toml
    assert patching.check("pair-top").ok

    patching.apply(host, "pair-base")
    patching.apply(host, "pair-top")
    assert (site / "sglang/srt/utils/new_helper.py").read_text() == "HELPER = True\n"
    assert patching.verify(host).ok
    undone = patching.revert(host)
    assert undone.record_ok and not (site / "sglang/srt/utils/new_helper.py").exists()


def test_new_patchset_first_diff_writes_patchset_toml(cache, patchsets_dir, sglang_wheel):
    laid = authoring.edit("brand-new", requires=["pair-base"])
    assert laid.new_patchset and laid.below == ["pair-base"] and laid.own_patches == []
    with pytest.raises(authoring.AuthoringError, match="no changes"):
        authoring.refresh("brand-new")
    target = laid.tree / "sglang/srt/utils/json_response.py"
    target.write_text(target.read_text().replace("PAIR_LEVEL = 'base'", "PAIR_LEVEL = 'new'"))
    git.Repo(laid.tree).git.commit("-qam", "a committed edit counts too")
    result = authoring.refresh("brand-new")
    assert result.wrote_toml and result.patch.name == "0001-brand-new.patch"
    meta = tomllib.loads((patchsets_dir / "brand-new" / "patchset.toml").read_text())
    assert meta["requires"] == ["pair-base"] and meta["order"] == 70
    assert result.patch == patchsets_dir / "brand-new" / "0.5.11" / "0001-brand-new.patch"
    assert patching.load_patchsets()["brand-new"].versions == ["0.5.11"]
    checked = patching.check("brand-new")
    assert checked.ok and checked.stack == ["pair-base", "brand-new"]


def test_patchset_toml_without_diffs_gets_its_first_release_from_refresh(cache, patchsets_dir):
    folder = patchsets_dir / "pending"
    folder.mkdir()
    (folder / "patchset.toml").write_text('name = "pending"\nsummary = "s"\npackage = "sglang"\n'
                                          'order = 25\nrequires = []\n')
    pending = patching.check("pending")
    assert not pending.ok and "pending has no diffs yet" in pending.error
    laid = authoring.edit("pending")
    assert laid.version == "0.5.11"
    (laid.tree / "sglang/version.py").write_text((laid.tree / "sglang/version.py").read_text() + "# pending\n")
    authoring.refresh("pending")
    assert (folder / "0.5.11" / "0001-pending.patch").exists() and patching.check("pending").ok
    image = patching.check("pending").files["0.5.11"]
    assert [f.path for f in image] == ["sglang/version.py"]
    fresh = authoring.edit("pending", fresh=True)
    assert (fresh.tree / "sglang/version.py").read_text().endswith("# pending\n")
    assert sha256(fresh.tree / "sglang/srt/utils/auth.py") == wheels.pristine("sglang", "0.5.11").record[
        "sglang/srt/utils/auth.py"]

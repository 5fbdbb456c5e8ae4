"""Patchset hooks (toolkit/patch/patchhooks.py): the engine calls what a patchset's hooks.py defines,
knowing nothing of the patchset. Synthetic patchsets in a private patchsets/ folder; no sshd."""
from __future__ import annotations

import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from toolkit.patch import patchhooks, patchsets
from toolkit.server import profiles, server
from toolkit.core.inventory import Host

HOST = Host(name="h", venv="/v", server={"model": "/m", "draft_model": "/d"})

ADDS_POLICY = """\
diff --git a/sglang/srt/policy.py b/sglang/srt/policy.py
new file mode 100644
--- /dev/null
+++ b/sglang/srt/policy.py
@@ -0,0 +1,2 @@
+def default(threshold):
+    return threshold - 1
"""


def make(folder: Path, name: str, hooks: str | None, order: int = 10, hooks_toml: str | None = None) -> None:
    (folder / name / "0.5.11").mkdir(parents=True)
    (folder / name / "0.5.11" / "0001.patch").write_text(ADDS_POLICY)
    toml = f'name = "{name}"\nsummary = "s"\npackage = "sglang"\norder = {order}\n'
    if hooks is not None:
        (folder / name / "hooks.py").write_text(textwrap.dedent(hooks))
        toml += hooks_toml if hooks_toml is not None else '[hooks]\nfile = "hooks.py"\n'
    elif hooks_toml is not None:
        toml += hooks_toml
    (folder / name / "patchset.toml").write_text(toml)


@pytest.fixture
def folder(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "patchsets"
    folder.mkdir()
    monkeypatch.setenv("TOOLKIT_PATCHSETS", str(folder))
    return folder


POLICY_HOOK = """\
def launch_values(ctx, values):
    if values["dyn_threshold"] is None or values["dyn_hysteresis"] is not None:
        return {}
    return {"dyn_hysteresis": ctx.added_module("sglang/srt/policy.py").default(values["dyn_threshold"])}
"""


def test_the_default_hysteresis_comes_from_whichever_patchset_hooks_it(folder):
    """Not the dyn-disable patchset: a synthetic one whose rule (threshold - 1, read out of the file
    its diff adds) differs from dyn-disable's, so the plan can only have it through the hook."""
    make(folder, "any-name", POLICY_HOOK)
    plan = server.plan(HOST, "eagle3-v2-dyn", {"dyn_threshold": 12})
    assert plan.dyn_hysteresis == 11 and plan.env["SGLANG_SPEC_DISABLE_HYSTERESIS"] == "11"
    assert profiles.default_hysteresis(40) == 39
    # a given hysteresis is kept; the hook is asked and leaves it
    assert server.plan(HOST, "eagle3-v2-dyn", {"dyn_threshold": 12, "dyn_hysteresis": 3}).dyn_hysteresis == 3


def test_without_a_hook_a_threshold_needs_its_hysteresis(folder):
    make(folder, "plain", None)
    with pytest.raises(profiles.ProfileError, match="no patchset's hook gives a default one: set dyn_hysteresis"):
        server.plan(HOST, "eagle3-v2-dyn")
    assert server.plan(HOST, "eagle3-v2-dyn", {"dyn_threshold": 9, "dyn_hysteresis": 4}).dyn_hysteresis == 4
    assert server.plan(HOST, "baseline").dyn_hysteresis is None      # no threshold: nothing asked


def test_later_patchsets_see_and_override_earlier_answers(folder):
    make(folder, "low", POLICY_HOOK, order=10)
    make(folder, "high", "def launch_values(ctx, values):\n    return {'dyn_hysteresis': values['dyn_hysteresis'] // 2}\n",
         order=20)
    assert patchhooks.launch_values({"dyn_threshold": 9, "dyn_hysteresis": None, "tp_size": 1}) == \
        {"dyn_threshold": 9, "dyn_hysteresis": 4, "tp_size": 1}


@pytest.mark.parametrize("hook, error", [
    ("def launch_values(ctx, values):\n    return {'port': 1}\n", "launch_values must return a dict of"),
    ("def launch_values(ctx, values):\n    return None\n", "launch_values must return a dict of"),
    ("import no_such_module_here\n", "its hook file hooks.py fails to load: ModuleNotFoundError"),
    ("def launch_values(ctx, values):\n    return {'dyn_hysteresis': ctx.added_module('sglang/srt/gone.py')}\n",
     "does not add sglang/srt/gone.py"),
])
def test_a_broken_hook_is_a_profile_error_naming_the_patchset(folder, hook, error):
    make(folder, "broken", hook)
    with pytest.raises(profiles.ProfileError, match="broken") as caught:
        server.plan(HOST, "eagle3-v2-dyn")
    assert error in str(caught.value)


@pytest.mark.parametrize("hooks_toml, error", [
    ('[hooks]\nfile = "../hooks.py"\n', "must name a .py file"),
    ('[hooks]\nfile = "sub/hooks.py"\n', "must name a .py file"),
    ('[hooks]\nfile = "missing.py"\n', "must name a .py file"),
    ('[hooks]\nfile = "hooks.txt"\n', "must name a .py file"),
    ('[hooks]\nmodule = "hooks.py"\n', "takes one key, file"),
])
def test_patchset_toml_refuses_a_hook_file_that_is_not_beside_it(folder, hooks_toml, error):
    make(folder, "bad", "X = 1\n", hooks_toml=hooks_toml)
    with pytest.raises(patchsets.PatchsetError, match=error):
        patchsets.load_all()


PREDICT_HOOK = """\
from dataclasses import dataclass

FACTS_PACKAGES = ["flashinfer-python"]


@dataclass
class Guess:
    host: str
    applied: bool
    title: str
    notes: list

    def rows(self):
        return [("gpus", str(self.count), "counted")]

    def lines(self):
        return ["{name}: " + str(self.count)]


def predict(ctx, found, tp_size, env):
    guess = Guess(found.host, ctx.name in found.raw["patch_state"]["stack"], ctx.name + " guess", [])
    guess.count = tp_size or len(found.gpus)
    return guess
"""


def fake_facts(stack):
    return SimpleNamespace(host="h", gpus=[{"index": 0}, {"index": 1}], raw={"patch_state": {"stack": stack}})


def test_predict_asks_only_the_named_patchsets_that_have_the_hook(folder):
    make(folder, "a", PREDICT_HOOK.replace("{name}", "a"), order=10)
    make(folder, "b", POLICY_HOOK, order=20)                    # hooks.py without predict
    make(folder, "c", PREDICT_HOOK.replace("{name}", "c"), order=30)
    found = fake_facts(["a"])
    assert [p.title for p in patchhooks.predict(found, ["c", "b", "a"])] == ["a guess", "c guess"]
    [only] = patchhooks.predict(found, ["c"], tp_size=1)
    assert (only.applied, only.lines()) == (False, ["c: 1"])
    assert patchhooks.predict(found, ["b"]) == []
    assert patchhooks.predict(found, ["not-a-patchset"]) == []


def test_predict_host_makes_no_round_trip_when_no_patchset_predicts(folder, monkeypatch):
    make(folder, "b", POLICY_HOOK)
    called = []
    monkeypatch.setattr(patchhooks.facts_engine, "gather", lambda *a, **k: called.append(k) or fake_facts([]))
    assert patchhooks.predict_host(HOST) == []
    assert called == []
    make(folder, "a", PREDICT_HOOK.replace("{name}", "a"))
    monkeypatch.setattr(patchhooks.facts_engine, "gather", lambda *a, **k: called.append(k) or fake_facts(["a"]))
    [guess] = patchhooks.predict_host(HOST)                   # None: the host's applied stack
    assert guess.applied and called == [{"transport": None, "extra_packages": ["flashinfer-python"]}]
    monkeypatch.setattr(patchhooks.facts_engine, "gather", lambda *a, **k: fake_facts([]))
    assert patchhooks.predict_host(HOST) == []                # "a" not applied there: nothing to say

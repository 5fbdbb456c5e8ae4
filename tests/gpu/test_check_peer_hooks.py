"""gpu/check_peer_hooks.py (issue #30 item 2 on paper) on a made-up sglang tree and hook table: a hook
is found in the class body, in a base class of the same module or of a module it imports from, and
an override's parameters must match exactly, a call's must be among the callee's."""
import json
import textwrap

import pytest

from .scripts import load_gpu_script


@pytest.fixture(scope="module")
def check():
    return load_gpu_script("check_peer_hooks")


def write(root, rel, text):
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


@pytest.fixture
def trees(tmp_path):
    sg, eh = tmp_path / "sg", tmp_path / "eh"
    write(sg, "sglang/__init__.py", "")
    write(sg, "sglang/srt/base.py", """
        class Base:
            def init_backends(self):
                pass
        """)
    write(sg, "sglang/srt/worker.py", """
        from .base import Base

        class Local:
            def shared(self, x):
                pass

        class Worker(Base, Local):
            size: int = 0

            def forward(self, batch, on_publish):
                pass

        def run(batch, device, extra=None):
            pass
        """)
    write(eh, "eagle_harness/sglang/hooks.py", """
        from typing import NamedTuple

        class Hook(NamedTuple):
            path: str
            params: tuple
            kind: str
            owner: str = ""
            optional: bool = False

        W = "sglang.srt.worker:Worker"
        HOOKS = (
            Hook(f"{W}.forward", ("batch", "on_publish"), "override"),
            Hook(f"{W}.init_backends", (), "override"),                 # from a base in another module
            Hook(f"{W}.shared", ("x",), "override"),                    # from a base in the same module
            Hook(f"{W}.size", (), "field"),
            Hook("sglang.srt.worker:run", ("batch", "device"), "call"),  # sglang may add optional ones
            Hook(f"{W}.forward", ("batch",), "override"),                # an override must match exactly
            Hook("sglang.srt.worker:run", ("batch", "step"), "call"),
            Hook(f"{W}.create_draft", (), "override"),
            Hook("sglang.srt.gone:Info.device", (), "field", optional=True),
        )
        """)
    return sg, eh


def test_each_hook_is_looked_up_through_bases_and_parameters(check, trees, tmp_path, capsys):
    sg, eh = trees
    rows = check.check(str(sg), check.load_hooks(str(eh)))
    assert [r["ok"] for r in rows] == [True, True, True, True, True, False, False, False, False]
    assert "the plugin overrides with ['batch']" in rows[5]["problem"]
    assert "lack ['step']" in rows[6]["problem"]
    assert rows[7]["problem"] == "Worker has no create_draft"
    assert rows[8]["problem"] == "no module sglang.srt.gone" and rows[8]["optional"]
    out = tmp_path / "rows.json"
    assert check.main([str(sg), str(eh), "--json", str(out)]) == 1   # required hooks missing
    assert "9 hooks, 5 found, 3 required ones missing" in capsys.readouterr().out
    assert len(json.loads(out.read_text())) == 9


def test_bad_trees_are_refused(check, trees, tmp_path):
    sg, eh = trees
    assert check.main([str(tmp_path / "nowhere"), str(eh)]) == 2
    assert check.main([str(sg), str(tmp_path / "nowhere")]) == 2

"""gpu/import_sweep.py on a made-up package: every missing third-party module is reported once by
its top-level name with the modules that needed it, other failures apart, the rest imported."""
import json
import subprocess
import sys

from .scripts import ROOT


def make_package(root):
    pkg = root / "swept"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "ok.py").write_text("import json\n")
    (pkg / "needs.py").write_text("import not_installed_xyz.core\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "also.py").write_text("from not_installed_xyz import a\n")
    (pkg / "sub" / "gone.py").write_text("from swept import trimmed_away\n")
    (pkg / "sub" / "platform.py").write_text('raise RuntimeError("only on NPU\\nsecond line")\n')
    (pkg / "skipped").mkdir()
    (pkg / "skipped" / "__init__.py").write_text("import another_missing\n")


def test_a_sweep_reports_every_missing_module_at_once(tmp_path):
    make_package(tmp_path)
    out = tmp_path / "sweep.json"
    run = subprocess.run([sys.executable, str(ROOT / "gpu" / "import_sweep.py"), "swept", "--skip", "swept.skipped",
                          "--json", str(out)], cwd=tmp_path, env={"PYTHONPATH": str(tmp_path)},
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    result = json.loads(out.read_text())
    assert result["missing"] == {"not_installed_xyz": ["swept.needs", "swept.sub.also"]}
    assert result["failed"] == {"swept.sub.platform": "RuntimeError: only on NPU",
                                "swept.sub.gone": "ImportError: cannot import name 'trimmed_away' from 'swept' "
                                                  f"({tmp_path / 'swept' / '__init__.py'})"}
    assert result["imported"] == 3   # swept, swept.ok, swept.sub; nothing under the skipped one
    assert "missing not_installed_xyz: needed by 2 module(s)" in run.stdout

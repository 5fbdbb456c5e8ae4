"""gpu/reproduce.py against round eight's 32-layer Kimi table (docs/evidence/dyn-disable-8/1-tp1-kimi32),
the table the GPU proof of issue #28 item 5 is to reproduce (gpu/README.md, "not yet run")."""
import json

import pytest

from .scripts import ROOT, load_gpu_script

EARLIER = ROOT / "docs" / "evidence" / "dyn-disable-8" / "1-tp1-kimi32" / "records.jsonl"


@pytest.fixture(scope="module")
def rep():
    return load_gpu_script("reproduce")


def scaled(records, factor, where=lambda r: True):
    return [dict(r, out_tok_per_s=r["out_tok_per_s"] * factor) if "out_tok_per_s" in r and where(r) else r
            for r in records]


def write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_the_earlier_table_has_the_cells_the_readme_quotes(rep):
    rows, code = rep.compare(rep.read(EARLIER), rep.read(EARLIER), 0.03)
    got = {(k[3], k[4]): round(before, 3) for k, before, *_ in rows}
    assert code == 0
    assert got[64, "baseline"] == 2850.9 and got[64, "eagle3-v2-dyn"] == 2868.2
    assert got[16, "eagle3-v2-dyn / baseline"] == 0.997 and got[32, "eagle3-v2-dyn / baseline"] == 1.017


def test_a_run_two_percent_faster_everywhere_reproduces_it(rep, tmp_path, capsys):
    new = write(tmp_path / "new.jsonl", scaled(rep.read(EARLIER), 1.02))
    assert rep.main([str(EARLIER), new, "--json", str(tmp_path / "v.json")]) == 0
    verdict = json.loads((tmp_path / "v.json").read_text())
    assert verdict["verdict"] == "reproduced" and len(verdict["rows"]) == 9
    assert "| kimi32-v2-tp1 | 128/160 | 64 | baseline | 2850.9 | 2907.9 | +2.0% | yes |" in capsys.readouterr().out


def test_one_server_four_percent_slower_at_one_level_does_not(rep):
    slower = scaled(rep.read(EARLIER), 0.96, lambda r: r["label"] == "baseline" and r["conc"] == 64)
    rows, code = rep.compare(rep.read(EARLIER), slower, 0.03)
    failed = {(k[3], k[4]) for k, *_, ok in rows if not ok}
    assert code == 1 and failed == {(64, "baseline"), (64, "eagle3-v2-dyn / baseline")}


def test_both_servers_faster_alike_keeps_the_ratios_but_not_the_figures(rep):
    rows, code = rep.compare(rep.read(EARLIER), scaled(rep.read(EARLIER), 1.05), 0.03)
    assert code == 1
    assert all(ok == ("/" in k[4]) for k, *_, ok in rows)


def test_a_level_that_did_not_run_is_missing_not_passed(rep, tmp_path):
    new = write(tmp_path / "new.jsonl", [r for r in rep.read(EARLIER) if r.get("conc") != 32])
    assert rep.main([str(EARLIER), new]) == 2

"""Every throughput table in the docs says which acceptance it used (issue #24, item 5).

Most dyn-disable figures were measured on dummy weights with the accept length forced by
`SGLANG_SIMULATE_ACC_LEN`; a few on a trained pair; baseline-only tables involve none. A reader
must be able to tell which, next to the table.

Rules (kept simple on purpose):
- Files: README.md, docs/*.md, docs/evidence/*/README.md, docs/evidence/*/summary.md.
- A markdown table is what markdown-it-py's GFM table rule parses as one (so a table inside a
  list item counts, and one inside a code block does not).
- It is a throughput table when its header names a speculative server or a comparison
  (eagle, dyn, spec, adaptive, baseline, tok/s, ratio, accept, or a ` / ` between two columns'
  names), or any of its cells holds a ratio figure such as `0.96x` or `1.2×` (with a decimal
  point, so `8 x H200` is not one).
- Such a table needs an acceptance statement within WINDOW lines above its header or below its
  last row: a line that starts (after markdown emphasis, list or quote marks) with
  `Acceptance:` and says one of "simulated N" (the value, e.g. "simulated 2.6"), "measured",
  "not involved" or "not determined".
"""
import re
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

ROOT = Path(__file__).resolve().parents[1]
WINDOW = 4
MARKDOWN = MarkdownIt("commonmark").enable("table")

HEADER_WORDS = re.compile(r"eagle|dyn|spec|adaptive|baseline|tok/s|ratio|accept| / ", re.I)
RATIO_CELL = re.compile(r"\b\d+\.\d+ ?[x×](?!\w)")
STATEMENT = re.compile(r"^[\s*_>\-]*Acceptance:")
KINDS = re.compile(r"simulated \d|measured|not involved|not determined", re.I)


def doc_files(root: Path) -> list[Path]:
    files = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    for name in ("README.md", "summary.md"):
        files += sorted((root / "docs" / "evidence").glob(f"*/{name}"))
    return [f for f in files if f.is_file()]


def tables(lines: list[str]):
    """(header index, last row index) of every table markdown-it's GFM table rule finds."""
    for token in MARKDOWN.parse("\n".join(lines)):
        if token.type == "table_open" and token.map:
            start, end = token.map
            yield start, end - 1


def is_throughput_table(lines: list[str], head: int, last: int) -> bool:
    if HEADER_WORDS.search(lines[head]):
        return True
    return any(RATIO_CELL.search(line) for line in lines[head + 2 : last + 1])


def has_statement(lines: list[str], head: int, last: int) -> bool:
    near = lines[max(0, head - WINDOW) : head] + lines[last + 1 : last + 1 + WINDOW]
    return any(STATEMENT.match(line) and KINDS.search(line) for line in near)


def unlabelled(root: Path) -> list[str]:
    missing = []
    for path in doc_files(root):
        lines = path.read_text(encoding="utf-8").splitlines()
        for head, last in tables(lines):
            if is_throughput_table(lines, head, last) and not has_statement(lines, head, last):
                missing.append(f"{path.relative_to(root)}:{head + 1}: {lines[head].strip()[:80]}")
    return missing


def test_every_throughput_table_says_its_acceptance():
    assert unlabelled(ROOT) == []


def test_the_rules_see_real_tables():
    # Guards against a rule that silently matches nothing: the docs hold many such tables.
    count = 0
    for path in doc_files(ROOT):
        lines = path.read_text(encoding="utf-8").splitlines()
        count += sum(is_throughput_table(lines, h, l) for h, l in tables(lines))
    assert count >= 30


UNLABELLED = """# t

| c | baseline | eagle3-v2-dyn | dyn / baseline |
|---|---|---|---|
| 16 | 100 | 96 | 0.96x |
"""


@pytest.mark.parametrize(
    "around, ok",
    [
        (("", ""), False),
        (("Acceptance: simulated 2.6 (`SGLANG_SIMULATE_ACC_LEN`).\n\n", ""), True),
        (("", "\n*Acceptance: measured (trained pair).*\n"), True),
        (("", "\n- Acceptance: not involved (baseline only).\n"), True),
        # a statement too far away, one that says nothing, or "simulated" without its value
        (("Acceptance: simulated 2.6.\n\n\n\n\n\n", ""), False),
        (("Acceptance: see above.\n", ""), False),
        (("Acceptance: simulated.\n", ""), False),
        # "acceptance" inside a sentence is not the statement
        (("The acceptance was simulated.\n", ""), False),
    ],
)
def test_rules_on_a_small_doc(tmp_path, around, ok):
    before, after = around
    (tmp_path / "docs").mkdir()
    body = UNLABELLED.replace("| c |", before + "| c |", 1) + after
    (tmp_path / "README.md").write_text(body, encoding="utf-8")
    assert (unlabelled(tmp_path) == []) is ok


def test_tables_without_speculation_need_no_statement(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(
        "| command | what it does |\n|---|---|\n| `invoke facts` | reads a host |\n", encoding="utf-8"
    )
    assert unlabelled(tmp_path) == []


def test_a_table_in_a_code_block_is_not_a_table(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("```\n" + UNLABELLED + "```\n", encoding="utf-8")
    assert unlabelled(tmp_path) == []


def test_a_table_in_a_list_item_is_checked(tmp_path):
    (tmp_path / "docs").mkdir()
    item = "- the sweep:\n\n" + "".join("  " + line + "\n" for line in UNLABELLED.splitlines()[2:])
    (tmp_path / "README.md").write_text(item, encoding="utf-8")
    assert len(unlabelled(tmp_path)) == 1
    labelled = item.replace("  | c |", "  *Acceptance: simulated 2.6.*\n\n  | c |", 1)
    (tmp_path / "README.md").write_text(labelled, encoding="utf-8")
    assert unlabelled(tmp_path) == []

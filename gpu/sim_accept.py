"""How a lab site's simulated acceptance draws its accept lengths: once per batch step (SGLang's own
`generate_simulated_accept_index`) or once per request (this lab's rewrite of it).

SGLang 0.5.11 draws one accept length per verify step and gives it to every request in the batch: by
default (`SGLANG_SIMULATE_ACC_METHOD=match-expected`, which the lab never changes) the mean's floor or
ceiling with the fraction's weight (1.6: 1 or 2, 0.4 / 0.6, mean 1.6), with `multinomial`
`torch.normal(mean, 1)` clamped to [1, steps + 1] and rounded (mean 1.75 at 1.6). A real draft's requests accept
independently. threshold=auto (0003) weighs accept lengths per request-step, so under the per-step
draw one probe step of 48 requests (weight 1 - 0.97^48 = 0.77) sets a bucket's estimate to one integer
draw: 1.0 / 2.0 / 3.0 at the buckets above 40 in every simulated auto run, at acceptance 1.6 and 2.5
alike (docs/evidence/auto-threshold/10-acc2.5-native-bursty). The per-request draw keeps the mean and
the spread of one request's draws and gives the batch mean a real draft's independence.

Device, after gpu/run_dyn.sh's setup (which runs it on every call, so that a warm machine's site
follows SIM_ACCEPT):
  python3 gpu/sim_accept.py per-request /tmp/site /tmp/stock /tmp/naive
  python3 gpu/sim_accept.py per-step /tmp/site ...       # back to SGLang's own (the default)
  python3 gpu/sim_accept.py mode /tmp/site               # which one a tree has
A tree without sglang is skipped. SGLang 0.5.11 only: another release's function (0.5.17 and 0.5.23
changed its signature) is refused, with the tree left as it was."""
from __future__ import annotations

import hashlib
import sys
from pathlib import Path
from typing import Optional

SITE = "/tmp/site"   # the sglang tree gpu/run_dyn.sh prepares, which the drivers' records describe
SPEC_UTILS = "sglang/srt/speculative/spec_utils.py"
FUNCTION = "def generate_simulated_accept_index("
SAVED = ".per-step"   # the untouched module, kept beside the rewritten one
MARK = "# toolkit lab: gpu/sim_accept.py per-request"
PER_STEP, PER_REQUEST = "per-step", "per-request"
# sha256 of 0.5.11's function text (from its def to the next top-level def)
KNOWN = {"671bd215430e7c2edef208a208800512556328263c3aaf8dcf76544deb928e85"}

ACC_LEN_FILE_ENV = "LAB_SIM_ACC_LEN_FILE"

PER_REQUEST_FUNCTION = f'''{MARK}: a server whose environment names a file in
# {ACC_LEN_FILE_ENV} takes its mean accept length from it while the file holds a number (read again
# when its mtime changes), so that a driver can move the acceptance between phases of a trace; TP=1
# only (ranks reading a change one step apart would draw different lengths)
_LAB_ACC_LEN_FILE = os.environ.get("{ACC_LEN_FILE_ENV}")
_LAB_ACC_LEN = [None, None]  # the file's mtime, its number


def _lab_acc_len(default):
    if not _LAB_ACC_LEN_FILE:
        return default
    try:
        mtime = os.stat(_LAB_ACC_LEN_FILE).st_mtime_ns
    except OSError:
        return default
    if mtime != _LAB_ACC_LEN[0]:
        try:
            with open(_LAB_ACC_LEN_FILE) as f:
                value = float(f.read().strip())
            _LAB_ACC_LEN[1] = value if value > 0 else None
        except (OSError, ValueError):
            _LAB_ACC_LEN[1] = None
        _LAB_ACC_LEN[0] = mtime
    return default if _LAB_ACC_LEN[1] is None else _LAB_ACC_LEN[1]


def generate_simulated_accept_index(
    accept_index,
    predict,
    num_accepted_drafts,
    bs,
    spec_steps,
    simulate_acc_len: float = SIMULATE_ACC_LEN,
    simulate_acc_method: str = SIMULATE_ACC_METHOD,
):
    {MARK}: one accept length per request, drawn as
    # SGLang draws its one per step (normal, sd 1, rounded, clamped to [1, spec_steps + 1]; or
    # match-expected's floor / ceiling with the fraction's weight)
    simulate_acc_len = _lab_acc_len(simulate_acc_len)
    assert simulate_acc_len > 0.0
    # drawn where the index lives (no copy to the GPU, no wait); the ranks' generators are seeded alike
    device = accept_index.device
    if simulate_acc_method == "multinomial":
        lengths = torch.normal(mean=simulate_acc_len, std=1.0, size=(bs,), device=device)
        lengths = torch.clamp(lengths, min=1.0, max=spec_steps + 1).round().to(torch.int64)
    elif simulate_acc_method == "match-expected":
        expected = max(1.0, min(spec_steps + 1, simulate_acc_len))
        lower = int(expected // 1)
        upper = lower + 1 if lower < spec_steps + 1 else lower
        up = torch.rand(bs, device=device) < (expected - lower)
        lengths = torch.where(up, upper, lower).to(torch.int64)
    else:
        raise ValueError(f"Invalid simulate_acc_method: {{simulate_acc_method!r}}")

    columns = torch.arange(spec_steps + 1, device=device)
    first = accept_index[:, 0].view(-1, 1)
    sim_accept_index = torch.where(
        columns.view(1, -1) < lengths.view(-1, 1), first + columns.view(1, -1), -1
    ).to(torch.int32)
    num_accepted_drafts.copy_((lengths - 1).to(num_accepted_drafts.dtype))
    predict.fill_(100)  # some legit token id
    return sim_accept_index

'''


class SimAcceptError(Exception):
    pass


def _span(text: str) -> tuple[int, int]:
    start = text.find(FUNCTION)
    if start < 0 or text.count(FUNCTION) != 1:
        raise SimAcceptError(f"{SPEC_UTILS}: no single {FUNCTION.rstrip('(')}")
    end = text.find("\ndef ", start + len(FUNCTION))
    return start, (len(text) if end < 0 else end + 1)


def function_sha(text: str) -> str:
    start, end = _span(text)
    return hashlib.sha256(text[start:end].encode()).hexdigest()


def rewrite(text: str) -> str:
    """spec_utils.py's text with the per-request function in place of 0.5.11's."""
    if MARK in text:
        return text
    sha = function_sha(text)
    if sha not in KNOWN:
        raise SimAcceptError(f"{SPEC_UTILS}: the function is not SGLang 0.5.11's (sha256 {sha[:12]}); "
                             "only 0.5.11's is rewritten")
    start, end = _span(text)
    return text[:start] + PER_REQUEST_FUNCTION + text[end:]


def mode(tree: Path) -> Optional[str]:
    """per-request, per-step, or None where the tree has no sglang."""
    path = Path(tree) / SPEC_UTILS
    if not path.is_file():
        return None
    return PER_REQUEST if MARK in path.read_text() else PER_STEP


def apply(tree: Path, wanted: str) -> Optional[str]:
    """Put the tree's draw in `wanted` mode; the mode it ends in (None: no sglang there)."""
    path = Path(tree) / SPEC_UTILS
    if not path.is_file():
        return None
    saved = path.with_name(path.name + SAVED)
    text = path.read_text()
    if wanted == PER_REQUEST and MARK not in text:
        new = rewrite(text)   # raises before anything is written
        compile(new, str(path), "exec")
        saved.write_text(text)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(new)
        tmp.replace(path)
    elif wanted == PER_STEP and MARK in text:
        if not saved.is_file():
            raise SimAcceptError(f"{path}: rewritten, and the untouched copy {saved.name} is gone")
        saved.replace(path)
    return mode(tree)


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in (PER_STEP, PER_REQUEST, "mode"):
        print(__doc__, file=sys.stderr)
        return 2
    verb, trees = argv[0], [Path(t) for t in argv[1:]]
    status = 0
    for tree in trees:
        try:
            got = mode(tree) if verb == "mode" else apply(tree, verb)
        except SimAcceptError as exc:
            print(f"sim_accept: {tree}: {exc}", file=sys.stderr)
            status = 1
            continue
        print(f"sim_accept: {tree}: {got or 'no sglang (skipped)'}")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Printing the sm120 gate prediction (toolkit/patch/sm120_gates.py) after `patch apply` and before
`server start`: per host, which Blackwell-workstation features the patched server will run."""
from __future__ import annotations

from rich.markup import escape

from toolkit.core import report
from toolkit.patch import sm120_gates
from toolkit.core.hostrun import HostScriptError
from toolkit.core.inventory import Host
from toolkit.core.transport import TransportError

PREDICTION_ERRORS = (TransportError, HostScriptError, sm120_gates.GateError)


def predict_or_reason(host: Host, tp_size: int | None = None, env: dict | None = None):
    """A Prediction, or the reason none could be made (a string): it never fails the command."""
    try:
        return sm120_gates.predict_host(host, tp_size=tp_size, env=env)
    except PREDICTION_ERRORS as exc:
        return f"{host.name}: sm120 features could not be predicted: {exc}"


def prediction_after_apply(host: Host, result):
    """After `patch apply` on one host: the prediction when sm120 is in the resulting stack."""
    if sm120_gates.PATCHSET in result.stack_after:
        return predict_or_reason(host)
    return None


def show(prediction, title_suffix: str = "") -> None:
    """A table of the features (on / off / stock, and why), or the reason there is none."""
    if prediction is None:
        return
    if isinstance(prediction, str):
        report.note(prediction)
        return
    gpus = ",".join(map(str, prediction.gpus)) or "none"
    report.table(f"{prediction.host}: sm120 features for TP {prediction.world_size} on GPU {gpus}{title_suffix}",
                 ["feature", "state", "why"], [(t, s, escape(w)) for t, s, w in prediction.rows()])
    for text in prediction.notes:
        report.note(f"{prediction.host}: {text}")


def note_before_start(prediction) -> None:
    """The lines the server will log, as progress before it starts (stderr)."""
    if isinstance(prediction, str):
        report.note(prediction)
    elif prediction is not None and prediction.applied:
        for text in prediction.lines():
            report.note(f"{prediction.host}: will log: {text}")

"""Printing what the applied patchsets' `predict` hooks (toolkit/patch/patchhooks.py) say a host's server
will decide at start: after `patch apply` and before `server start`."""
from __future__ import annotations

from rich.markup import escape

from toolkit.patch import patchhooks
from toolkit.core import report
from toolkit.core.hostrun import HostScriptError
from toolkit.core.inventory import Host
from toolkit.patch.patchsets import PatchsetError
from toolkit.core.transport import TransportError

PREDICTION_ERRORS = (TransportError, HostScriptError, PatchsetError, patchhooks.HookError)


def predict_or_reason(host: Host, names=None, tp_size: int | None = None, env: dict | None = None):
    """Predictions, or the reason none could be made (a string): it never fails the command.
    `names` None: the patchsets applied on the host."""
    try:
        return patchhooks.predict_host(host, names, tp_size=tp_size, env=env)
    except PREDICTION_ERRORS as exc:
        return f"{host.name}: what the patched server will decide could not be predicted: {exc}"


def after_apply(host: Host, result):
    """After `patch apply` on one host: the predictions of the patchsets in the resulting stack."""
    return predict_or_reason(host, list(result.stack_after))


def show(predictions) -> None:
    """Per prediction a table of the features (on / off / stock, and why), or the reason there is none."""
    if isinstance(predictions, str):
        report.note(predictions)
        return
    for prediction in predictions or []:
        report.table(prediction.title, ["feature", "state", "why"], [(t, s, escape(w)) for t, s, w in prediction.rows()])
        for text in prediction.notes:
            report.note(f"{prediction.host}: {text}")


def note_before_start(predictions) -> None:
    """The lines the server will log, as progress before it starts (stderr)."""
    if isinstance(predictions, str):
        report.note(predictions)
        return
    for prediction in predictions or []:
        if prediction.applied:
            for text in prediction.lines():
                report.note(f"{prediction.host}: will log: {text}")

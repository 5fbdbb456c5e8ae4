"""Patchset hooks: what one patchset knows, called by the generic engine without knowing which.

A patchset may declare a hook file in its patchset.toml,

    [hooks]
    file = "hooks.py"

a Python file beside patchset.toml that the toolkit loads (it is never shipped to a host). Every
function in it is optional; the engine calls the ones a patchset defines:

  launch_values(ctx, values) -> dict
      `values` are the launch settings a profile resolved (`dyn_threshold`, `dyn_hysteresis`,
      `tp_size`; None where unset); the hook returns those the patched server fills in itself
      (its defaults), so that the launch plan, its expected log lines and bench records name them.
  predict(ctx, facts, tp_size, env) -> a prediction
      from one `invoke facts` answer (toolkit.provision.facts.Facts): what the patched server will decide at
      start, before it starts. The prediction has `host`, `title`, `applied`, `notes`, `rows()`
      (feature, state, why), `lines()` (the log lines the server will write) and `to_json()`.
  FACTS_PACKAGES = [...]
      distributions whose installed versions `predict` needs (looked up in the facts round trip).

`ctx` (HookContext) names the patchset and loads files the patchset adds to the package
(`ctx.added_module(path)`), so a hook can run the very code the patched server runs.
"""
from __future__ import annotations

import hashlib
import sys
import types
from dataclasses import dataclass

from toolkit.provision import facts as facts_engine
from toolkit.patch import patchsets
from toolkit.core.inventory import Host
from toolkit.provision.stack import Stack, normalize

LAUNCH_KEYS = ("dyn_threshold", "dyn_hysteresis", "tp_size")


class HookError(ValueError):
    """A patchset's hook file cannot be loaded, or a hook answered something unusable."""


@dataclass(frozen=True)
class HookContext:
    name: str
    known: dict

    def added_module(self, path: str) -> types.ModuleType:
        """A file this patchset adds to its package (`path` relative to site-packages), as a module."""
        return patchsets.added_module(self.name, path, self.known)


_LOADED: dict[str, types.ModuleType] = {}


def load(name: str, known: dict | None = None) -> types.ModuleType | None:
    """Patchset `name`'s hook module, or None when it declares none (cached per content)."""
    known = known if known is not None else patchsets.load_all()
    patchset = patchsets.get(name, known)
    if "file" not in patchset.hooks:
        return None
    path = patchset.folder / patchset.hooks["file"]
    try:
        text = path.read_text()
    except OSError as exc:
        raise HookError(f"{name}: cannot read its hook file: {exc}") from None
    key = hashlib.sha256(f"{name}\0{text}".encode()).hexdigest()
    if key not in _LOADED:
        module = types.ModuleType(f"toolkit_patchset_hooks_{name.replace('-', '_')}_{key[:12]}")
        module.__file__ = str(path)
        sys.modules[module.__name__] = module  # dataclasses look their module up there
        try:
            exec(compile(text, str(path), "exec"), module.__dict__)
        except Exception as exc:
            del sys.modules[module.__name__]
            raise HookError(f"{name}: its hook file {patchset.hooks['file']} fails to load: "
                            f"{type(exc).__name__}: {exc}") from exc
        _LOADED[key] = module
    return _LOADED[key]


def with_hook(function: str, names=None, known: dict | None = None) -> list[tuple[str, types.ModuleType]]:
    """(name, module) of each patchset (of `names`, default all) whose hook file defines `function`,
    in stacking order."""
    known = known if known is not None else patchsets.load_all()
    chosen = [n for n in (known if names is None else names) if n in known]
    found = []
    for name in patchsets.sort_stack(chosen, known):
        module = load(name, known)
        if module is not None and callable(getattr(module, function, None)):
            found.append((name, module))
    return found


def launch_values(values: dict, known: dict | None = None) -> dict:
    """`values` with what each patchset's `launch_values` hook fills in (later patchsets win)."""
    known = known if known is not None else patchsets.load_all()
    result = dict(values)
    for name, module in with_hook("launch_values", known=known):
        answer = module.launch_values(HookContext(name, known), dict(result))
        if not isinstance(answer, dict) or set(answer) - set(LAUNCH_KEYS):
            raise HookError(f"{name}: launch_values must return a dict of {', '.join(LAUNCH_KEYS)}, not {answer!r}")
        result.update(answer)
    return result


def predict(found: facts_engine.Facts, names, tp_size: int | None = None, env: dict | None = None,
            known: dict | None = None) -> list:
    """The predictions of the patchsets `names` (those with a `predict` hook) from one facts answer."""
    known = known if known is not None else patchsets.load_all()
    return [module.predict(HookContext(name, known), found, tp_size, env or {})
            for name, module in with_hook("predict", names, known)]


def applied_stack(found: facts_engine.Facts) -> list[str]:
    return list((found.raw.get("patch_state") or {}).get("stack") or [])


def predict_host(host: Host, names=None, tp_size: int | None = None, env: dict | None = None,
                 stack: Stack | None = None, transport=None, known: dict | None = None) -> list:
    """One facts round trip to `host` (only when a patchset of `names` has a `predict` hook), then
    `predict`. `names` None: the patchsets the host has applied."""
    known = known if known is not None else patchsets.load_all()
    hooked = with_hook("predict", names, known)
    if not hooked:
        return []
    extra = sorted({normalize(p) for _, module in hooked for p in getattr(module, "FACTS_PACKAGES", [])})
    found = facts_engine.gather(host, stack, transport=transport, extra_packages=extra)
    tp_size = tp_size or _host_tp(host)
    return predict(found, applied_stack(found) if names is None else names, tp_size, env, known)


def _host_tp(host: Host) -> int | None:
    value = (host.server or {}).get("tp_size")
    return int(value) if value else None

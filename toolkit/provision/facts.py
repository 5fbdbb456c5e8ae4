"""Facts about a host in one round trip (`invoke facts`, and the check half of provision).

`gather(host, stack)` runs `toolkit/hostside/facts.py` on the host and returns a `Facts`:
OS, the Python that runs SGLang (venv, or a system Python plus a bare site dir on
PYTHONPATH), free disk, installed versions of every package the stack pins (from
dist-info METADATA, nothing imported), GPUs, driver and CUDA from nvidia-smi, and
whether the venv's CUDA 13 nvcc runs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from toolkit.core import hostrun
from toolkit.core.inventory import Host
from toolkit.hostside.facts import describe_installed
from toolkit.provision.stack import Pin, Stack, normalize, version_matches
from toolkit.core.transport import Transport


def host_venv(host: Host, stack: Stack | None) -> str | None:
    """The venv provisioning manages: the inventory's, else the stack's default (not for a
    host that runs from a bare site dir on PYTHONPATH)."""
    if host.venv:
        return host.venv
    if host.pythonpath or host.python:
        return None
    return stack.venv if stack else None


def state_dir(host: Host, stack: Stack | None) -> str | None:
    if host.state_dir:
        return host.state_dir
    base = host_venv(host, stack) or host.pythonpath
    return f"{base}/.toolkit" if base else None


@dataclass
class Facts:
    host: str
    raw: dict
    round_trips: int = 1
    notes: list[str] = field(default_factory=list)

    @property
    def packages(self) -> dict[str, dict]:
        return self.raw.get("packages", {})

    def version(self, name: str) -> str | None:
        entry = self.packages.get(normalize(name))
        return entry["version"] if entry else None

    def cuda_build(self, name: str) -> str | None:
        """The CUDA version a package was built for ("13.0"), where the host could read it
        (torch: torch/version.py); None for a CPU build or when unknown."""
        return self.packages.get(normalize(name), {}).get("cuda")

    def pin_matches(self, pin: Pin) -> bool:
        return version_matches(self.version(pin.name), pin.version, self.cuda_build(pin.name))

    def describe(self, name: str) -> str:
        """`torch 2.11.0 (CUDA 13.0 build)`: the words the host side uses for the same entry."""
        return describe_installed(self.packages.get(normalize(name)) or {}, normalize(name))

    @property
    def python_version(self) -> str | None:
        target = self.raw.get("python", {})
        return target.get("version") if target.get("runs") else None

    @property
    def creator_version(self) -> str:
        return self.raw["creator"]["version"]

    @property
    def venv_exists(self) -> bool:
        return bool(self.raw.get("venv", {}).get("exists"))

    @property
    def gpus(self) -> list[dict]:
        return self.raw.get("gpus", [])

    @property
    def driver(self) -> str | None:
        return self.raw.get("driver")

    @property
    def driver_major(self) -> int | None:
        try:
            return int(str(self.driver).split(".")[0])
        except ValueError:
            return None

    @property
    def interconnect(self) -> dict:
        """P2P per GPU pair, NVLink, PCIe links, multicast (hostside/facts.py interconnect_facts)."""
        return self.raw.get("interconnect") or {}

    @property
    def nvcc(self) -> dict:
        return self.raw.get("nvcc", {})

    def python_tag(self) -> str | None:
        """`3.11` for the interpreter that runs (or will run) SGLang."""
        version = self.python_version or self.creator_version
        return ".".join(version.split(".")[:2]) if version else None

    def platform_tag(self) -> str:
        """The manylinux tag this host accepts, e.g. `manylinux_2_36_x86_64` (pip expands it downwards)."""
        os_facts = self.raw["os"]
        machine = os_facts.get("machine") or "x86_64"
        if os_facts.get("libc") == "glibc" and os_facts.get("libc_version"):
            major, minor = os_facts["libc_version"].split(".")[:2]
            return f"manylinux_{major}_{minor}_{machine}"
        return f"linux_{machine}"

    def summary_rows(self) -> list[tuple[str, str]]:
        r = self.raw
        target = r.get("python", {})
        rows = [("os", f"{r['os']['name']} ({r['os']['machine']}, kernel {r['os']['kernel']},"
                       f" {r['os'].get('libc') or 'libc?'} {r['os'].get('libc_version') or ''})".replace(" )", ")")),
                ("python3", f"{r['creator']['version']} ({r['creator']['python']})"
                            + ("" if r["creator"]["ensurepip"] else "; cannot make venvs: no ensurepip"))]
        venv = r.get("venv", {})
        if venv.get("path"):
            state = "present" if venv["exists"] else (f"cannot be used: {venv['unreadable']}"
                                                      if venv.get("unreadable") else "missing")
            rows.append(("venv", f"{venv['path']} ({state})"))
        if r.get("pythonpath"):
            rows.append(("pythonpath", r["pythonpath"]))
        if target.get("runs"):
            rows.append(("target python", f"{target['version']} ({target['interpreter']})"))
        else:
            rows.append(("target python", f"not runnable: {target.get('error', '?')}"))
        disk = r.get("disk", {})
        if disk.get("free_bytes") is not None:
            rows.append(("free disk", f"{disk['free_bytes'] / 2**30:.1f} GiB at {disk['path']}"))
        if r.get("gpus"):
            for gpu in r["gpus"]:
                rows.append((f"gpu {gpu['index']}", f"{gpu['name']}, capability {gpu['capability']},"
                                                   f" {gpu['memory_used_mib']} / {gpu['memory_total_mib']} MiB used"))
            rows.append(("driver", f"{r.get('driver')} (CUDA {r.get('cuda') or '?'})"))
            rows += interconnect_rows(self.interconnect)
        else:
            rows.append(("gpus", f"none ({r.get('error') or 'nvidia-smi lists no GPU'})"))
            rows.append(("interconnect", "none (no GPU)"))
        nvcc = r.get("nvcc", {})
        if nvcc.get("path"):
            state = f"runs, CUDA {nvcc['release']} (V{nvcc['version']})" if nvcc.get("runs") else f"fails: {nvcc.get('output')}"
            rows.append(("nvcc", f"{state}: {nvcc['path']}"))
        else:
            rows.append(("nvcc", "not installed (no site-packages/nvidia/cu13/bin/nvcc)"))
        torch = self.packages.get("torch", {})
        if torch.get("cuda_note"):
            rows.append(("torch build", torch["cuda_note"]))
        for command, where in sorted(r.get("commands", {}).items()):
            rows.append((command, where or "missing"))
        state = r.get("patch_state")
        if state:
            stack = ", ".join(state["stack"]) if state.get("stack") else "none"
            rows.append(("patches", f"{state.get('package')} {state.get('version')}: {stack} ({state['path']})"))
        return rows

    def package_rows(self, stack: Stack | None) -> list[tuple[str, str, str, str]]:
        """(package, installed, pinned, where) for the stack's pins (or everything found)."""
        rows = []
        if stack:
            for pin in stack.pins:
                entry = self.packages.get(pin.name)
                rows.append((pin.name, entry["version"] if entry else "missing", pin.version,
                             entry["location"] if entry else ""))
        else:
            for name, entry in sorted(self.packages.items()):
                rows.append((name, entry["version"], "", entry["location"]))
        return rows


def _ranges(ids) -> str:
    """[0, 1, 2, 3, 6] -> '0-3,6'."""
    ids, parts, start = sorted(set(ids)), [], None
    for i, value in enumerate(ids):
        start = value if start is None else start
        if i + 1 == len(ids) or ids[i + 1] != value + 1:
            parts.append(str(start) if start == value else f"{start}-{value}")
            start = None
    return ",".join(parts)


def _pair_summary(pairs: dict, key: str) -> str:
    """'OK between every pair of GPU 0-7', or the status words with the pairs that have them."""
    by_status: dict[str, list[str]] = {}
    gpus = set()
    for name, entry in pairs.items():
        a, b = (int(x) for x in name.split("-"))
        gpus.update((a, b))
        if a < b:
            status = entry.get(key) or "unknown"
            other = (pairs.get(f"{b}-{a}") or {}).get(key) or "unknown"
            by_status.setdefault(status if status == other else f"{status}/{other}", []).append(f"{a}<->{b}")
    if not by_status:
        return "no GPU pairs"
    if len(by_status) == 1:
        return f"{next(iter(by_status))} between every pair of GPU {_ranges(gpus)}"
    parts = []
    for status, names in sorted(by_status.items(), key=lambda kv: (kv[0] != "OK", kv[0])):
        shown = ", ".join(names[:4]) + (f" (+{len(names) - 4} more)" if len(names) > 4 else "")
        parts.append(f"{status}: {shown}")
    return "; ".join(parts)


def interconnect_rows(ic: dict) -> list[tuple[str, str]]:
    """Table rows for `invoke facts`: NVLink, P2P access and atomics, PCIe links, multicast."""
    if not ic:
        return [("interconnect", "not read (nvidia-smi gave no GPU list)")]
    gpus, pairs, rows = ic.get("gpus") or {}, ic.get("pairs") or {}, []
    links = {g: v.get("nvlink_links") for g, v in gpus.items()}
    if ic.get("nvlink"):
        groups: dict[object, list[int]] = {}
        for g, n in links.items():
            groups.setdefault(n, []).append(int(g))
        bonded = sorted(set(p.get("link") for p in pairs.values() if str(p.get("link")).startswith("NV")))
        rows.append(("nvlink", "; ".join(f"{'?' if n is None else n} links on GPU {_ranges(ids)}"
                                         for n, ids in sorted(groups.items(), key=lambda kv: str(kv[0])))
                     + (f" ({', '.join(bonded)} between pairs)" if bonded else "")))
    elif ic.get("nvlink") is False:
        rows.append(("nvlink", "none (PCIe only)"))
    else:
        rows.append(("nvlink", "unknown"))
    if pairs:
        rows.append(("p2p read/write", _pair_summary(pairs, "read")
                     if all(p.get("read") == p.get("write") for p in pairs.values())
                     else f"read: {_pair_summary(pairs, 'read')}; write: {_pair_summary(pairs, 'write')}"))
        rows.append(("p2p atomics", _pair_summary(pairs, "atomics")))
        rows.append(("topology", _pair_summary(pairs, "link")))
    pcie: dict[str, list[int]] = {}
    for g, v in gpus.items():
        link = v.get("pcie")
        text = (f"gen {link['gen']} x{link['width']} now, gen {link['gen_max']} x{link['width_max']} max"
                if link else "unknown")
        pcie.setdefault(text, []).append(int(g))
    if pcie:
        rows.append(("pcie", "; ".join(f"{text} on GPU {_ranges(ids)}" for text, ids in sorted(pcie.items()))))
    state = {True: "yes", False: "no", None: "unknown"}[ic.get("multicast")]
    rows.append(("multicast", f"{state} ({ic.get('multicast_why') or 'not read'})"))
    if ic.get("errors"):
        rows.append(("interconnect errors", "; ".join(ic["errors"])))
    return rows


def facts_args(host: Host, stack: Stack | None, extra_packages=()) -> dict:
    names = list(stack.package_names) if stack else []
    names += [normalize(n) for n in extra_packages if normalize(n) not in names]
    return {"venv": host_venv(host, stack), "python": host.python, "pythonpath": host.pythonpath,
            "packages": names, "commands": sorted(stack.system) if stack else [],
            "state_dir": state_dir(host, stack)}


def gather(host: Host, stack: Stack | None = None, transport: Transport | None = None,
           extra_packages=()) -> Facts:
    """One round trip to the host; `transport` lets a caller reuse (and count) its connection."""
    own = transport is None
    transport = transport or host.connect()
    try:
        before = transport.round_trips
        raw = hostrun.run_script(transport, "facts", facts_args(host, stack, extra_packages), timeout=300)
        return Facts(host=host.name, raw=raw, round_trips=transport.round_trips - before)
    finally:
        if own:
            transport.close()

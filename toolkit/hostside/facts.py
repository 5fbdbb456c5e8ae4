# Facts about a host in one round trip: OS, Python, disk, venv, installed versions of the
# stack's packages (read from dist-info METADATA, nothing imported), GPUs and driver from
# nvidia-smi, and whether the venv's CUDA 13 nvcc runs. Standard library only, Python 3.8+.
#
# Three layouts are handled alike: a venv (`venv`), a bare site dir on PYTHONPATH over a
# system Python (`pythonpath` + `python`), or both. The packages are looked up along the
# target interpreter's own sys.path, first hit wins, exactly as an import would resolve.
import glob
import json
import os
import platform
import re
import shutil
import subprocess
import sys

from ._lib import owner_name, user_name

NVCC_RELATIVE = os.path.join("nvidia", "cu13", "bin", "nvcc")
GPU_QUERY = "index,name,compute_cap,memory.used,memory.total,driver_version"

_PROBE = (
    "import sys, json, platform, importlib.util as u\n"
    "print(json.dumps({'version': platform.python_version(), 'path': sys.path,"
    " 'prefix': sys.prefix, 'base_prefix': getattr(sys, 'base_prefix', sys.prefix),"
    " 'executable': sys.executable, 'implementation': platform.python_implementation()}))\n"
)


def normalize(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def run(argv, timeout=60, env=None):
    """(exit code, stdout, stderr); a missing program is exit 127, a hang is exit 124."""
    try:
        done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              universal_newlines=True, timeout=timeout, env=env)
        return done.returncode, done.stdout, done.stderr
    except FileNotFoundError as exc:
        return 127, "", str(exc)
    except PermissionError as exc:
        return 126, "", str(exc)
    except subprocess.TimeoutExpired:
        return 124, "", "timed out after %ss" % timeout


def target_env(pythonpath):
    """The environment SGLang's Python runs with: the inventory's pythonpath and nothing else
    (a PYTHONPATH inherited from the caller, e.g. the toolkit's own in local mode, is dropped)."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return env


def target_interpreter(args):
    """The Python that runs SGLang on this host, or None when its venv does not exist yet."""
    if args.get("python"):
        return args["python"]
    venv = args.get("venv")
    if venv:
        candidate = os.path.join(venv, "bin", "python")
        return candidate if os.path.exists(candidate) else None
    return "python3"


def unreachable(path):
    """Why this user cannot reach PATH although something is there (a folder on its way, links
    followed, that it may not enter), or None. Only asked when PATH seems not to exist."""
    current, hops = os.path.abspath(path), 0
    while hops < 40:
        folder, parts = os.sep, current.strip(os.sep).split(os.sep)
        for part in parts[:-1]:
            folder = os.path.join(folder, part)
            if os.path.isdir(folder) and not os.access(folder, os.X_OK):
                mode = "mode %o" % (os.stat(folder).st_mode & 0o7777)
                via = "" if current == os.path.abspath(path) else " (%s leads there)" % path
                return "%s%s: folder %s is not readable by %s (%s, owner %s)" % (
                    current, via, folder, user_name(), mode, owner_name(folder))
        if not os.path.islink(current):
            return None
        current = os.path.normpath(os.path.join(os.path.dirname(current), os.readlink(current)))
        hops += 1
    return None


def probe_interpreter(interpreter, pythonpath):
    code, out, err = run([interpreter, "-c", _PROBE], timeout=60, env=target_env(pythonpath))
    if code != 0:
        return {"interpreter": interpreter, "runs": False, "error": (out + err).strip()[-800:]}
    info = json.loads(out.strip().splitlines()[-1])
    info.update(interpreter=interpreter, runs=True)
    return info


def site_dirs(sys_path):
    return [p for p in sys_path if p and os.path.isdir(p)]


def _metadata(dist_dir):
    for name in ("METADATA", "PKG-INFO"):
        path = os.path.join(dist_dir, name)
        if os.path.isfile(path):
            found = {}
            with open(path, encoding="utf-8", errors="replace") as f:
                for line in f:
                    if not line.strip():
                        break
                    key, _, value = line.partition(":")
                    if key in ("Name", "Version") and key not in found:
                        found[key] = value.strip()
            return found
    return {}


def installed_versions(dirs, wanted):
    """{normalized name: {"version", "location", "dist_info"}} for the names in `wanted`."""
    wanted = set(normalize(n) for n in wanted)
    found = {}
    for site in dirs:
        try:
            entries = sorted(os.listdir(site))
        except OSError:
            continue
        for entry in entries:
            if not (entry.endswith(".dist-info") or entry.endswith(".egg-info")):
                continue
            stem = entry.rsplit(".", 1)[0]
            guess = normalize(stem.split("-", 1)[0])
            if guess not in wanted or guess in found:
                continue
            meta = _metadata(os.path.join(site, entry))
            name = normalize(meta.get("Name", guess))
            if name in wanted and name not in found and meta.get("Version"):
                found[name] = {"version": meta["Version"], "location": site,
                               "dist_info": os.path.join(site, entry)}
                if name in CUDA_BUILD_FILES:
                    found[name].update(cuda_build(site, CUDA_BUILD_FILES[name]))
    return found


# -- the version rule, shared with the control side ------------------------------------

def _release(version):
    head = re.match(r"^v?(\d+(?:\.\d+)*)(.*)$", version)
    if not head:
        return version
    parts = head.group(1).split(".")
    while len(parts) > 1 and parts[-1] == "0":
        parts.pop()
    return ".".join(parts) + head.group(2).replace("-", ".").replace("_", ".")


def cuda_label(cuda):
    major, _, minor = cuda.strip().partition(".")
    return "cu" + major + minor.split(".")[0]


def version_matches(installed, pinned, cuda=None):
    """PEP 440 `==` for release pins: a pin without a local label (`2.13.0`) accepts any
    local build of it (`2.13.0+cpu`); a pin with one (`2.11.0+cu130`) needs exactly that,
    except that an unlabelled install (PyPI's default torch wheel, `2.11.0`) counts when its
    CUDA build is known to be that one: `cuda` = "13.0" (read from torch/version.py).
    The one copy of the rule: the control side (toolkit.stack) imports it from here."""
    if not installed:
        return False
    have_public, _, have_local = installed.strip().lower().partition("+")
    want_public, _, want_local = pinned.strip().lower().partition("+")
    if _release(have_public) != _release(want_public):
        return False
    if not want_local or have_local == want_local:
        return True
    return not have_local and bool(cuda) and want_local == cuda_label(cuda)


def describe_installed(entry, name):
    """`torch 2.11.0 (CUDA 13.0 build)`: the build is named where the version has no label to say it."""
    have = entry.get("version")
    if not have:
        return "%s missing" % name
    if entry.get("cuda_note") and "+" not in have:
        return "%s %s (%s)" % (name, have, entry["cuda_note"])
    return "%s %s" % (name, have)


# PyPI's default Linux torch wheel is a CUDA build whose version has no `+cuXYZ` label, so
# the label alone cannot tell the build: torch writes it into torch/version.py (read, not imported).
CUDA_BUILD_FILES = {"torch": os.path.join("torch", "version.py")}
_CUDA_LINE = re.compile(r"""^cuda\s*(?::[^=\n]*)?=\s*(?:None|(['"])([^'"\n]*)\1)\s*(?:#.*)?$""", re.M)


def cuda_build(site, relative):
    """{"cuda": "13.0" or None, "cuda_known": bool, "cuda_note": what to tell the user}."""
    path = os.path.join(site, relative)
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return {"cuda": None, "cuda_known": False, "cuda_note": "CUDA build unknown: no %s" % path}
    match = _CUDA_LINE.search(text)
    if not match:
        return {"cuda": None, "cuda_known": False, "cuda_note": "CUDA build unknown: no cuda = line in %s" % path}
    cuda = match.group(2) or None
    return {"cuda": cuda, "cuda_known": True,
            "cuda_note": "CUDA %s build" % cuda if cuda else "no CUDA build (cuda = None)"}


def nvcc_facts(dirs):
    for site in dirs:
        path = os.path.join(site, NVCC_RELATIVE)
        if os.path.exists(path):
            code, out, err = run([path, "--version"], timeout=60)
            match = re.search(r"release (\d+\.\d+), V([\d.]+)", out)
            lines = (out + err).strip().splitlines()
            return {"path": path, "runs": code == 0, "release": match.group(1) if match else None,
                    "version": match.group(2) if match else None, "output": lines[-1] if lines else ""}
    return {"path": None, "runs": False, "release": None, "version": None, "output": "no nvidia/cu13/bin/nvcc"}


# What the sm120 gates need from the installed kernels, read as text (nothing imported): the archs
# FlashInfer's JIT builds its TRT-LLM all-reduce module for, and whether the deep_gemm found first
# on sys.path has the SM120 branch's entry point (the runtime probe imports it and asks hasattr).
DEEP_GEMM_SM120_ENTRY_POINT = "m_grouped_fp8_fp4_gemm_nt_contiguous"


def trtllm_comm_majors(comm_py_text):
    """supported_major_versions of gen_trtllm_comm_module in flashinfer/jit/comm.py, or None."""
    match = re.search(r"def gen_trtllm_comm_module\(.*?(?=\ndef |\Z)", comm_py_text or "", re.S)
    found = match and re.search(r"supported_major_versions\s*=\s*\[([0-9,\s]*)\]", match.group(0))
    if not found:
        return None
    return [int(x) for x in found.group(1).replace(" ", "").split(",") if x]


def kernel_facts(dirs):
    found = {"flashinfer_trtllm_comm_majors": None, "flashinfer_comm_py": None,
             "deep_gemm": {"present": False, "sm120_entry_point": None, "path": None}}
    for site in dirs:
        path = os.path.join(site, "flashinfer", "jit", "comm.py")
        if os.path.isfile(path):
            with open(path, encoding="utf-8", errors="replace") as f:
                found["flashinfer_trtllm_comm_majors"] = trtllm_comm_majors(f.read())
            found["flashinfer_comm_py"] = path
            break
    for site in dirs:
        path = os.path.join(site, "deep_gemm", "__init__.py")
        if os.path.isfile(path):
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read()
            found["deep_gemm"] = {"present": True, "sm120_entry_point": DEEP_GEMM_SM120_ENTRY_POINT in text,
                                  "path": path}
            break
    return found


def gpu_facts():
    smi = shutil.which("nvidia-smi")
    if not smi:
        return {"nvidia_smi": None, "gpus": [], "driver": None, "cuda": None, "error": "nvidia-smi not found"}
    code, out, err = run([smi, "--query-gpu=" + GPU_QUERY, "--format=csv,noheader,nounits"], timeout=60)
    if code != 0:
        return {"nvidia_smi": smi, "gpus": [], "driver": None, "cuda": None,
                "error": "nvidia-smi failed (exit %s): %s" % (code, (out + err).strip()[-400:])}
    gpus, driver = [], None
    for line in out.strip().splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) < 6:
            continue
        index, name, capability, used, total, driver = cells[:6]
        gpus.append({"index": _int(index), "name": name, "capability": capability,
                     "memory_used_mib": _int(used), "memory_total_mib": _int(total)})
    code, out, err = run([smi], timeout=60)
    match = re.search(r"CUDA Version:\s*([\d.]+)", out)
    return {"nvidia_smi": smi, "gpus": gpus, "driver": driver, "cuda": match.group(1) if match else None,
            "error": None, "interconnect": interconnect_facts(smi, [g["index"] for g in gpus])}


# -- how the GPUs reach each other: P2P, NVLink, PCIe link, multicast --------------------------

PCIE_QUERY = "index,pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current,pcie.link.width.max"
# nvidia-smi topo -p2p <capability>: read, write, atomics, nvlink
P2P_CAPABILITIES = {"r": "read", "w": "write", "a": "atomics", "n": "nvlink"}


ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


def parse_gpu_matrix(text):
    """{(row, column): cell} for the GPU rows/columns of `nvidia-smi topo -m` or `topo -p2p X`:
    a header line naming GPU0 GPU1 ... (then NICs, CPU Affinity, ...) and one row per GPU.
    nvidia-smi underlines the header with terminal escapes (ESC[4m ... ESC[0m), pipe or not."""
    columns, cells = None, {}
    for line in ANSI_ESCAPE.sub("", text or "").splitlines():
        tokens = line.split()
        if not tokens:
            if columns and cells:
                break
            continue
        if columns is None:
            if tokens[0] == "GPU0":
                columns = [int(t[3:]) for t in tokens if re.match(r"^GPU\d+$", t)]
            continue
        if not re.match(r"^GPU\d+$", tokens[0]):
            if tokens[0] == "Legend:":
                break
            continue
        row = int(tokens[0][3:])
        for column, cell in zip(columns, tokens[1:1 + len(columns)]):
            cells[(row, column)] = cell
    return cells


def parse_nvlink_status(text):
    """{gpu index: active links} from `nvidia-smi nvlink -s` ("Link N: 26.562 GB/s"; inactive ones say so)."""
    links, current = {}, None
    for line in (text or "").splitlines():
        head = re.match(r"^GPU (\d+):", line)
        if head:
            current = int(head.group(1))
            links[current] = 0
        elif current is not None and re.search(r"Link \d+:\s*[\d.]+\s*GB/s", line):
            links[current] += 1
    return links


def parse_fabric(text):
    """[(state, status)] per GPU, in order, from the Fabric blocks of `nvidia-smi -q`."""
    found, block = [], None
    for line in (text or "").splitlines():
        stripped = line.strip()
        if stripped == "Fabric":
            block = {}
            continue
        if block is None:
            continue
        key, _, value = stripped.partition(":")
        if key.strip() in ("State", "Status") and key.strip().lower() not in block:
            block[key.strip().lower()] = value.strip()
        if len(block) == 2:
            found.append((block["state"], block["status"]))
            block = None
    return found


def _cell_int(text):
    try:
        return int(text)
    except (TypeError, ValueError):
        return None


def interconnect_facts(smi, indices):
    """P2P status per GPU pair, NVLink links, PCIe link per GPU, multicast; each command that
    fails is listed under `errors` and leaves its part unknown (None)."""
    facts = {"pairs": {}, "gpus": {}, "nvlink": None, "multicast": None, "multicast_why": "", "errors": []}
    if len(indices) == 0:
        return facts
    for gpu in indices:
        facts["gpus"][str(gpu)] = {"pcie": None, "nvlink_links": None, "fabric": None}
    for a in indices:
        for b in indices:
            if a != b:
                facts["pairs"]["%d-%d" % (a, b)] = {"read": None, "write": None, "atomics": None, "nvlink": None,
                                                    "link": None}
    code, out, err = run([smi, "topo", "-m"], timeout=60)
    if code == 0:
        for (a, b), cell in parse_gpu_matrix(out).items():
            if a != b and "%d-%d" % (a, b) in facts["pairs"]:
                facts["pairs"]["%d-%d" % (a, b)]["link"] = cell
    else:
        facts["errors"].append("topo -m: exit %s: %s" % (code, (out + err).strip()[-200:]))
    for flag, name in sorted(P2P_CAPABILITIES.items()):
        code, out, err = run([smi, "topo", "-p2p", flag], timeout=60)
        if code != 0:
            facts["errors"].append("topo -p2p %s: exit %s: %s" % (flag, code, (out + err).strip()[-200:]))
            continue
        for (a, b), cell in parse_gpu_matrix(out).items():
            if a != b and "%d-%d" % (a, b) in facts["pairs"]:
                facts["pairs"]["%d-%d" % (a, b)][name] = cell
    code, out, err = run([smi, "nvlink", "-s"], timeout=60)
    if code == 0:
        for gpu, count in parse_nvlink_status(out).items():
            if str(gpu) in facts["gpus"]:
                facts["gpus"][str(gpu)]["nvlink_links"] = count
    else:
        facts["errors"].append("nvlink -s: exit %s: %s" % (code, (out + err).strip()[-200:]))
    code, out, err = run([smi, "--query-gpu=" + PCIE_QUERY, "--format=csv,noheader,nounits"], timeout=60)
    if code == 0:
        for line in out.strip().splitlines():
            cells = [c.strip() for c in line.split(",")]
            if len(cells) == 5 and str(_cell_int(cells[0])) in facts["gpus"]:
                gen, gen_max, width, width_max = [_cell_int(c) for c in cells[1:]]
                facts["gpus"][cells[0]]["pcie"] = {"gen": gen, "gen_max": gen_max, "width": width,
                                                    "width_max": width_max}
    else:
        facts["errors"].append("pcie query: exit %s: %s" % (code, (out + err).strip()[-200:]))
    links = [g["nvlink_links"] for g in facts["gpus"].values()]
    pair_links = [p["link"] for p in facts["pairs"].values()]
    if any(l for l in links) or any(str(l).startswith("NV") for l in pair_links):
        facts["nvlink"] = True
    elif all(l == 0 for l in links) or (pair_links and all(l is not None for l in pair_links)):
        facts["nvlink"] = False
    if facts["nvlink"] is False:
        facts["multicast"] = False
        facts["multicast_why"] = "no NVLink: CUDA multicast objects need NVLink"
    elif facts["nvlink"]:
        code, out, err = run([smi, "-q"], timeout=120)
        fabric = parse_fabric(out) if code == 0 else []
        for gpu, state in zip(sorted(indices), fabric):
            facts["gpus"][str(gpu)]["fabric"] = "%s/%s" % state
        facts["multicast_why"] = ("NVLink present; multicast also needs NVSwitch and the fabric manager"
                                  " (nvidia-smi does not report it; SGLang probes it at start)")
        if fabric:
            facts["multicast_why"] += "; fabric %s" % ", ".join(sorted(set("%s/%s" % f for f in fabric)))
    else:
        facts["multicast_why"] = "NVLink presence unknown"
    return facts


def _int(text):
    try:
        return int(float(text))
    except ValueError:
        return None


def os_facts():
    pretty = None
    try:
        with open("/etc/os-release") as f:
            for line in f:
                if line.startswith("PRETTY_NAME="):
                    pretty = line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
    libc, libc_version = platform.libc_ver()
    return {"name": pretty or platform.system(), "kernel": platform.release(), "machine": platform.machine(),
            "libc": libc, "libc_version": libc_version, "hostname": platform.node()}


def disk_facts(path):
    probe = path or os.path.expanduser("~")
    while probe and not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    try:
        usage = shutil.disk_usage(probe)
        return {"path": probe, "free_bytes": usage.free, "total_bytes": usage.total}
    except OSError as exc:
        return {"path": probe, "free_bytes": None, "total_bytes": None, "error": str(exc)}


def venv_creator():
    """Can this python3 make a venv with pip in it? (Debian splits ensurepip into python3-venv.)"""
    import importlib.util
    spec = importlib.util.find_spec("ensurepip")
    bundled = []
    if spec and spec.origin:
        bundled = glob.glob(os.path.join(os.path.dirname(spec.origin), "_bundled", "pip-*.whl"))
    debian = glob.glob("/usr/share/python-wheels/pip-*.whl")
    return {"python": sys.executable, "version": platform.python_version(), "ensurepip": bool(bundled or debian)}


def patch_state(state_dir):
    if not state_dir:
        return None
    path = os.path.join(state_dir, "patch", "state.json")
    try:
        with open(path) as f:
            state = json.load(f)
    except (OSError, ValueError):
        return None
    stack = [e.get("name") if isinstance(e, dict) else e for e in state.get("stack") or []]
    return {"path": path, "package": state.get("package"), "version": state.get("version"),
            "stack": stack, "files": len(state.get("files") or {})}


def main(args):
    venv = args.get("venv")
    pythonpath = args.get("pythonpath")
    venv_cfg = os.path.join(venv, "pyvenv.cfg") if venv else None
    facts = {
        "os": os_facts(),
        "creator": venv_creator(),
        # a venv half made by a concurrent provision (config written, no python yet) counts as missing
        "venv": {"path": venv, "exists": bool(venv_cfg and os.path.isfile(venv_cfg)
                                              and os.path.exists(os.path.join(venv, "bin", "python")))},
        "pythonpath": pythonpath,
        "disk": disk_facts(venv or pythonpath),
        "commands": dict((c, shutil.which(c)) for c in args.get("commands", [])),
        "patch_state": patch_state(args.get("state_dir")),
    }
    if venv and not facts["venv"]["exists"]:
        # "missing" only when nothing is there: a venv (or the Python its interpreter links to)
        # in a folder this user may not enter is there, and unusable
        facts["venv"]["unreadable"] = unreachable(venv_cfg) or unreachable(os.path.join(venv, "bin", "python"))
    interpreter = target_interpreter(args)
    dirs = []
    if interpreter:
        target = probe_interpreter(interpreter, pythonpath)
        if target.get("runs"):
            dirs = site_dirs(target["path"])
        target["site_dirs"] = dirs
        target.pop("path", None)
    else:
        target = {"interpreter": os.path.join(venv, "bin", "python"), "runs": False,
                  "error": facts["venv"].get("unreadable") or "venv does not exist"}
    facts["python"] = target
    facts["packages"] = installed_versions(dirs, args.get("packages", [])) if dirs else {}
    facts["nvcc"] = nvcc_facts(dirs)
    facts["kernels"] = kernel_facts(dirs)
    facts.update(gpu_facts())
    return facts

"""Whole physical cores for servers to be pinned to (stdlib only; tests/gpu/test_cpu_pin.py).

On the trained pair a server's step is host work: its scheduler holds one core at 100 % while the
GPU sits at 9-15 % (docs/evidence/auto-threshold/25-probe-log, host_samples.jsonl), and one
server's rounds at one load read up to 43 % apart with no steal time, the cores at one clock and
the GPU at one clock. Where the kernel runs that one thread (next to a busy hyperthread sibling,
on another NUMA node than its memory) is what is left to vary; a server pinned from its start to
a physical core of its own takes the placement out, and an unpinned twin beside it shows whether
that was the noise (`auto_device.py --pin`).
"""
import os

SYS_CPU = "/sys/devices/system/cpu"
SYS_NODE = "/sys/devices/system/node"


def parse_cpulist(text):
    """'0-3,8,10-11' -> {0, 1, 2, 3, 8, 10, 11}."""
    cpus = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def _read(path):
    with open(path) as f:
        return f.read().strip()


def topology(sys_cpu=SYS_CPU, sys_node=SYS_NODE, allowed=None):
    """[{cpu, core, package, node}] for each logical CPU this process may run on (`allowed`,
    default its own affinity): core and package from sysfs, node -1 where sysfs has no nodes."""
    allowed = set(os.sched_getaffinity(0)) if allowed is None else set(allowed)
    nodes = {}
    if os.path.isdir(sys_node):
        for entry in os.listdir(sys_node):
            if entry.startswith("node") and entry[4:].isdigit():
                for cpu in parse_cpulist(_read(os.path.join(sys_node, entry, "cpulist"))):
                    nodes[cpu] = int(entry[4:])
    rows = []
    for cpu in sorted(allowed):
        base = os.path.join(sys_cpu, f"cpu{cpu}", "topology")
        try:
            core, package = int(_read(os.path.join(base, "core_id"))), int(_read(os.path.join(base, "physical_package_id")))
        except (OSError, ValueError):
            core, package = cpu, 0   # no topology: every CPU its own core
        rows.append({"cpu": cpu, "core": core, "package": package, "node": nodes.get(cpu, -1)})
    return rows


def pick_cores(rows, n):
    """n disjoint sets of logical CPUs, each one whole physical core (its hyperthread siblings
    together), all on the node with the most cores, the core holding the lowest CPU left for the
    rest of the machine. Raises ValueError when that node has fewer than n + 1 cores."""
    by_core = {}
    for r in rows:
        by_core.setdefault((r["node"], r["package"], r["core"]), set()).add(r["cpu"])
    per_node = {}
    for (node, _, _), cpus in by_core.items():
        per_node.setdefault(node, []).append(cpus)
    node, cores = max(per_node.items(), key=lambda kv: (len(kv[1]), -kv[0]))
    cores.sort(key=min)
    if len(cores) < n + 1:
        raise ValueError(f"node {node} has {len(cores)} physical cores: {n} to pin and one for the rest need {n + 1}")
    return [sorted(c) for c in cores[1:n + 1]]


def describe(rows):
    """One line: logical CPUs, physical cores, packages, nodes."""
    cores = {(r["package"], r["core"]) for r in rows}
    return (f"{len(rows)} logical CPUs, {len(cores)} physical cores, "
            f"{len({r['package'] for r in rows})} package(s), {len({r['node'] for r in rows})} node(s)")


def proc_stats(proc_root="/proc"):
    """{pid: (name, parent pid, utime + stime in jiffies)} of every process readable now, from
    /proc/PID/stat (gpu/host_sampler.py reads its CPU times from it too)."""
    out = {}
    for entry in os.listdir(proc_root):
        if not entry.isdigit():
            continue
        try:
            text = _read(os.path.join(proc_root, entry, "stat"))
        except OSError:  # gone since listdir
            continue
        # the name is in parentheses and may hold spaces or parentheses itself
        name = text[text.index("(") + 1:text.rindex(")")]
        fields = text[text.rindex(")") + 2:].split()
        out[int(entry)] = (name, int(fields[1]), int(fields[11]) + int(fields[12]))
    return out


def process_tree(root_pid, proc_root="/proc"):
    """root_pid and every process descended from it, from /proc/*/stat's parent ids."""
    parents = {pid: parent for pid, (_, parent, _) in proc_stats(proc_root).items()}
    tree, frontier = {root_pid}, [root_pid]
    while frontier:
        pid = frontier.pop()
        kids = [child for child, parent in parents.items() if parent == pid and child not in tree]
        tree.update(kids)
        frontier.extend(kids)
    return tree


def pin_tree(root_pid, cpus, proc_root="/proc"):
    """Every thread of root_pid's process tree onto cpus; returns how many threads were pinned.
    The tree inherited cpus at its start (auto_device.inherited_affinity); this sets them again
    once it is up, since a library may bind its own threads (OpenMP's, for one)."""
    pinned = 0
    for pid in process_tree(root_pid, proc_root):
        try:
            tids = [int(t) for t in os.listdir(os.path.join(proc_root, str(pid), "task"))]
        except OSError:
            continue
        for tid in tids:
            try:
                os.sched_setaffinity(tid, cpus)
                pinned += 1
            except OSError:   # exited since the listing
                pass
    return pinned

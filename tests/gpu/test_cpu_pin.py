"""gpu/cpu_pin.py: the cores `auto_device.py --pin` gives servers, on a fake sysfs and on this
machine's own processes."""
import os
import subprocess
import sys
import time

import pytest

from .scripts import load_gpu_script


@pytest.fixture(scope="module")
def pin():
    return load_gpu_script("cpu_pin")


def fake_sysfs(tmp_path, cpus):
    """cpus: {cpu: (core, package, node)}."""
    nodes = {}
    for cpu, (core, package, node) in cpus.items():
        top = tmp_path / "cpu" / f"cpu{cpu}" / "topology"
        top.mkdir(parents=True)
        (top / "core_id").write_text(f"{core}\n")
        (top / "physical_package_id").write_text(f"{package}\n")
        nodes.setdefault(node, []).append(str(cpu))
    for node, members in nodes.items():
        (tmp_path / "node" / f"node{node}").mkdir(parents=True)
        (tmp_path / "node" / f"node{node}" / "cpulist").write_text(",".join(members) + "\n")
    (tmp_path / "node" / "possible").write_text("0-1\n")   # not a node directory: skipped
    return str(tmp_path / "cpu"), str(tmp_path / "node")


def test_a_cpulist_reads_ranges_and_single_cpus(pin):
    assert pin.parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert pin.parse_cpulist("") == set()


def test_each_pinned_server_gets_a_whole_core_of_the_larger_node_and_the_first_core_is_left(pin, tmp_path):
    # node 0: cores 0-2 with hyperthread siblings 8-10; node 1: cores 0-1 (cpus 4, 5) without
    cpus = {0: (0, 0, 0), 1: (1, 0, 0), 2: (2, 0, 0), 8: (0, 0, 0), 9: (1, 0, 0), 10: (2, 0, 0),
            4: (0, 1, 1), 5: (1, 1, 1)}
    sys_cpu, sys_node = fake_sysfs(tmp_path, cpus)
    rows = pin.topology(sys_cpu, sys_node, allowed=cpus)
    assert {r["cpu"]: r["node"] for r in rows} == {c: n for c, (_, _, n) in cpus.items()}
    assert pin.pick_cores(rows, 2) == [[1, 9], [2, 10]]
    assert pin.describe(rows) == "8 logical CPUs, 5 physical cores, 2 package(s), 2 node(s)"
    with pytest.raises(ValueError, match="node 0 has 3 physical cores: 3 to pin and one for the rest need 4"):
        pin.pick_cores(rows, 3)


def test_cpus_without_topology_count_as_cores_of_their_own(pin, tmp_path):
    rows = pin.topology(str(tmp_path / "none"), str(tmp_path / "none"), allowed={0, 1, 2})
    assert rows == [{"cpu": c, "core": c, "package": 0, "node": -1} for c in (0, 1, 2)]
    assert pin.pick_cores(rows, 2) == [[1], [2]]


def test_a_process_tree_is_pinned_thread_by_thread_children_included(pin):
    # a parent whose child starts after a moment: both must end on one CPU
    code = ("import subprocess, sys, time\n"
            "kid = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(20)'])\n"
            "print(kid.pid, flush=True)\n"
            "time.sleep(20)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        kid = int(parent.stdout.readline())
        assert pin.process_tree(parent.pid) == {parent.pid, kid}
        target = {min(os.sched_getaffinity(0))}
        assert pin.pin_tree(parent.pid, target) >= 2
        assert os.sched_getaffinity(parent.pid) == target and os.sched_getaffinity(kid) == target
    finally:
        subprocess.run(["pkill", "-P", str(parent.pid)], check=False)
        parent.kill()
        parent.wait()


def test_a_server_started_under_inherited_affinity_keeps_it_and_the_driver_gets_its_own_back(tmp_path):
    driver = load_gpu_script("auto_device")
    mine = os.sched_getaffinity(0)
    target = {max(mine)}
    with driver.inherited_affinity(sorted(target)):
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
    try:
        time.sleep(0.1)
        assert os.sched_getaffinity(proc.pid) == target
        assert os.sched_getaffinity(0) == mine
    finally:
        proc.kill()
        proc.wait()
    with driver.inherited_affinity(None):   # not pinned: nothing changes
        assert os.sched_getaffinity(0) == mine

"""The memory a learner's machine needs for each notebook: its kernel and all its ranks, measured.

Each notebook is executed top to bottom as `tools/nb.py` executes it (nbclient, a `python3`
Jupyter kernel, the working directory set to the notebook's own folder, so relative paths resolve
as in JupyterLab). The notebook is read into memory and never written: the committed `.ipynb`
stays as it is. While it runs, a thread samples every `SAMPLE_S` the memory of every process below
this one: the kernel, the forkserver that the rank pools fork from (course_lib/runtime/pool.py),
every rank, torchrun and its workers, the JAX process. The peak of the sum is what the notebook
needs.

The sum is of PSS (proportional set size, "Pss:" in /proc/PID/smaps_rollup): a page shared by n
processes counts 1/n in each. The ranks are forks of one forkserver that imported torch, so they
share torch's libraries and the server's pages; summing RSS counts every shared page once per
rank and overstates what the machine needs (with 8 ranks, by about 8 times the shared part). The
RSS sum is recorded beside it for comparison; the table's verdicts use PSS. Also recorded: the
largest single process (its PSS, and its VmHWM, the kernel's own RSS high-water mark, which a
sample cannot miss).

What the tree leaves out, added as a margin before a verdict: the Jupyter server and a browser
tab with JupyterLab open (a headless Chromium; both measured here once, `measure_jupyter_server`),
and an allowance for the operating system (stated, not measured: `MACHINES`). A Codespace's or
Colab's browser tab runs on the learner's own computer, so only a laptop's margin includes it.

    python tools/notebook_memory.py measure notebooks/*.ipynb   # -> tools/notebook_memory.json
    python tools/notebook_memory.py server                      # the Jupyter server, once
    python tools/notebook_memory.py table                       # the README's table from the JSON

Linux only (/proc). Run it under `nice -n 10` on a shared machine: memory does not depend on
load, time does. (A little over 300 lines: the sampler, what it samples and the table it fills are
read together.) Samples 50 ms apart can miss a peak shorter than that; the numbers are a floor
for such spikes, which is why the margin is generous.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from importlib import metadata

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_JSON = ROOT / "tools" / "notebook_memory.json"
SAMPLE_S = 0.05
GIB = 2**30
# Machines a learner may have: (label, memory in vendor GB (10^9 bytes) converted to GiB, the
# allowance for the operating system in GiB, whether the browser tab runs on the same machine).
# The GB -> GiB conversion is conservative where the RAM is really sold in GiB (a "16 GB" laptop
# has 16 GiB). The OS allowances are stated, not measured: 1 GiB for a headless Linux VM (kernel,
# daemons, the page cache torch's libraries need), 3 GiB for a laptop's desktop and other programs.
# A Codespace's or Colab's browser tab runs on the learner's own computer; a laptop's on the laptop.
MACHINES = (("8 GB Codespace", 8e9 / GIB, 1.0, False), ("~12 GB Colab", 12e9 / GIB, 1.0, False),
            ("16 GB laptop", 16e9 / GIB, 3.0, True))
# A rank is a child of the forkserver the pools fork from (course_lib/runtime/pool.py) or of torchrun.
LAUNCHERS = ("multiprocessing.forkserver", "torchrun", "torch.distributed.run")
TABLE_HEADER = "| notebook | ranks (most at once) | peak PSS, kernel + ranks | peak RSS sum | largest process (PSS) |"


# ---------------------------------------------------------------- sampling /proc


def _parent_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # gone between listing and reading
            continue
        ppid = int(stat[stat.rindex(b")") + 2:].split()[1])  # the name may hold spaces and ')'
        children.setdefault(ppid, []).append(int(entry.name))
    return children


def descendants(root: int, children: dict[int, list[int]] | None = None) -> list[int]:
    """Every process below `root` (not `root` itself), found from each process's parent id."""
    children, out, todo = _parent_map() if children is None else children, [], [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            out.append(child)
            todo.append(child)
    return out


def read_memory(pid: int) -> tuple[int, int] | None:
    """(PSS, RSS) of one process in bytes, from one read of smaps_rollup; None if it is gone."""
    pss = rss = None
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    pss = int(line.split()[1]) * 1024
                elif line.startswith("Rss:"):
                    rss = int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None if pss is None or rss is None else (pss, rss)


def _hwm_and_cmd(pid: int) -> tuple[int, str]:
    try:
        status = pathlib.Path(f"/proc/{pid}/status").read_text()
        cmd = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return 0, ""
    hwm = next((int(l.split()[1]) * 1024 for l in status.splitlines() if l.startswith("VmHWM:")), 0)
    return hwm, cmd


class TreeSampler(threading.Thread):
    """Samples the processes below `root` (and `root` itself if `include_root`) every `interval_s`.

    `peak_pss` is the largest sum of PSS over one sample; `peak_rss_sum` the largest sum of RSS
    (its own maximum, maybe at another sample); `largest_pss` the largest one process reached.
    """

    def __init__(self, root: int, include_root: bool = False, interval_s: float = SAMPLE_S):
        super().__init__(daemon=True)
        self.root, self.include_root, self.interval_s = root, include_root, interval_s
        self.peak_pss = self.peak_rss_sum = self.largest_pss = self.largest_hwm = 0
        self.processes_at_peak = self.most_processes = self.most_ranks = self.samples = 0
        self.largest_cmd = ""
        self._halt = threading.Event()

    def sample(self) -> int:
        """One sample; returns its PSS sum in bytes."""
        children = _parent_map()
        pids = descendants(self.root, children) + ([self.root] if self.include_root else [])
        pss_sum = rss_sum = alive = 0
        launchers = set()
        for pid in pids:
            mem = read_memory(pid)
            if mem is None:
                continue
            alive += 1
            pss_sum += mem[0]
            rss_sum += mem[1]
            hwm, cmd = _hwm_and_cmd(pid)
            if any(name in cmd for name in LAUNCHERS):
                launchers.add(pid)
            self.largest_hwm = max(self.largest_hwm, hwm)
            if mem[0] > self.largest_pss:
                self.largest_pss, self.largest_cmd = mem[0], cmd[:120]
        ranks = sum(len(children.get(pid, ())) for pid in launchers)
        self.samples += 1
        self.most_processes = max(self.most_processes, alive)
        self.most_ranks = max(self.most_ranks, ranks)
        self.peak_rss_sum = max(self.peak_rss_sum, rss_sum)
        if pss_sum > self.peak_pss:
            self.peak_pss, self.processes_at_peak = pss_sum, alive
        return pss_sum

    def run(self) -> None:
        while not self._halt.is_set():
            start = time.monotonic()
            self.sample()
            self._halt.wait(max(0.0, self.interval_s - (time.monotonic() - start)))

    def stop(self) -> dict:
        self._halt.set()
        self.join()
        return {"peak_pss": self.peak_pss, "peak_rss_sum": self.peak_rss_sum,
                "largest_process_pss": self.largest_pss, "largest_process_vmhwm": self.largest_hwm,
                "largest_process_cmd": self.largest_cmd, "processes_at_peak": self.processes_at_peak,
                "most_processes": self.most_processes, "most_ranks": self.most_ranks,
                "samples": self.samples}


# ---------------------------------------------------------------- measuring


def measure_notebook(path: pathlib.Path, cwd: pathlib.Path | None = None) -> dict:
    import nbformat
    from nbclient import NotebookClient
    sys.path.insert(0, str(ROOT / "tools"))
    from nb import CELL_TIMEOUT_S  # tools/nb.py's; three times it here, nice'd on a shared machine

    nb = nbformat.read(path, as_version=4)  # in memory only: never written back
    # As `make test` runs them: OpenMP's idle threads sleep instead of spinning on the cores the
    # ranks wait for (CONTRIBUTING.md); no tensor and no allocation changes.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    sampler = TreeSampler(os.getpid(), include_root=False)  # the kernel and everything below it
    sampler.start()
    start = time.perf_counter()
    try:
        NotebookClient(nb, timeout=3 * CELL_TIMEOUT_S, kernel_name="python3", store_widget_state=False,
                       resources={"metadata": {"path": str((cwd or path.parent).resolve())}}).execute()
    finally:
        result = sampler.stop()
    result["seconds"] = round(time.perf_counter() - start, 1)
    # What the sampler achieved: on a loaded machine, nice'd, far more than SAMPLE_S apart.
    result["mean_sample_interval_s"] = round(result["seconds"] / max(result["samples"], 1), 3)
    return result


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure_jupyter_server(settle_s: float = 5.0) -> dict:
    """PSS and RSS of a JupyterLab server (`make lab`'s command) after it served the /lab page."""
    port, token = _free_port(), "notebook-memory"
    jupyter = pathlib.Path(sys.executable).parent / "jupyter"
    proc = subprocess.Popen([str(jupyter), "lab", "--no-browser", f"--port={port}", "--ServerApp.ip=127.0.0.1",
                             f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={ROOT}", "--allow-root"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/lab?token={token}", timeout=5).read()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("the Jupyter server did not answer within 120 s")
                time.sleep(0.5)
        time.sleep(settle_s)
        sampler = TreeSampler(proc.pid, include_root=True)
        for _ in range(10):
            sampler.sample()
            time.sleep(0.1)
        result = {"pss": sampler.peak_pss, "rss_sum": sampler.peak_rss_sum,
                  "jupyterlab": metadata.version("jupyterlab")}
        chromium = shutil.which("chromium") or shutil.which("chromium-browser")
        if chromium:  # the browser tab, as a headless Chromium with JupyterLab open in it
            result["browser"] = measure_browser(chromium, f"http://127.0.0.1:{port}/lab?token={token}")
            sampler.sample()  # the server again, now that it serves the tab
            result.update(pss=sampler.peak_pss, rss_sum=sampler.peak_rss_sum)
        return result
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def measure_browser(chromium: str, url: str, seconds: float = 60.0) -> dict:
    """Peak PSS of a headless Chromium (all its processes) over the `seconds` after it opened `url`.

    JupyterLab's page (shell, launcher, file browser) renders in headless Chromium: its DOM, dumped
    on this machine, holds the jp-LabShell, jp-Launcher and jp-DirListing elements."""
    with tempfile.TemporaryDirectory() as profile:
        browser = subprocess.Popen([chromium, "--headless=new", "--no-sandbox", "--disable-gpu",
                                    "--no-first-run", f"--user-data-dir={profile}", url],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            sampler = TreeSampler(browser.pid, include_root=True)
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                sampler.sample()
                time.sleep(0.5)
            return {"pss": sampler.peak_pss, "rss_sum": sampler.peak_rss_sum,
                    "processes": sampler.most_processes, "chromium": chromium}
        finally:
            browser.terminate()
            browser.wait(timeout=30)


def machine() -> dict:
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    mem = next(int(l.split()[1]) * 1024 for l in open("/proc/meminfo") if l.startswith("MemTotal:"))
    return {"cpu": cpu, "cores": len(os.sched_getaffinity(0)), "memory_bytes": mem,
            "python": platform.python_version(), "torch": metadata.version("torch"),
            "os": f"{platform.system()} {platform.release()}"}


# ---------------------------------------------------------------- the table


def margin_gib(data: dict, os_gib: float, browser_here: bool) -> float:
    """What a machine needs besides the notebook: the OS allowance, the Jupyter server and, where
    the browser runs on the same machine, the browser tab (both measured, PSS)."""
    server = data["jupyter_server"]
    return os_gib + server["pss"] / GIB + (server["browser"]["pss"] / GIB if browser_here else 0.0)


def render_table(data: dict) -> str:
    """The README's table, from the JSON `measure` wrote: one row per notebook, in name order."""
    names = [machine[0] for machine in MACHINES]
    lines = [TABLE_HEADER + "".join(f" {n} |" for n in names),
             "|" + "---|" * (5 + len(names))]
    for name in sorted(data["notebooks"]):
        r = data["notebooks"][name]
        cells = [name.removesuffix(".ipynb"), str(r["most_ranks"]), f"{r['peak_pss'] / GIB:.2f} GiB",
                 f"{r['peak_rss_sum'] / GIB:.2f} GiB", f"{r['largest_process_pss'] / GIB:.2f} GiB"]
        for _, capacity, os_gib, browser_here in MACHINES:
            free = capacity - margin_gib(data, os_gib, browser_here) - r["peak_pss"] / GIB
            cells.append(f"✓ ({free:.1f} GiB left)" if free >= 0 else f"✗ ({-free:.1f} GiB short)")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def readme_table(text: str) -> str | None:
    """The table in `text` that starts with TABLE_HEADER's columns, or None."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith(TABLE_HEADER):
            end = i
            while end < len(lines) and lines[end].startswith("|"):
                end += 1
            return "\n".join(lines[i:end])
    return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=pathlib.Path, default=DEFAULT_JSON)
    sub = parser.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure", help="execute notebooks one at a time, merge their peaks into the JSON")
    m.add_argument("notebooks", nargs="+", type=pathlib.Path)
    m.add_argument("--cwd", type=pathlib.Path, help="the kernel's working directory (default: each "
                   "notebook's folder); for a copy of a notebook kept elsewhere")
    sub.add_parser("server", help="measure the Jupyter server once, into the JSON")
    sub.add_parser("table", help="print the README's table from the JSON")
    args = parser.parse_args(argv)
    if args.cmd == "table":
        data = json.loads(args.json.read_text())
        print(render_table(data) + "\n\n" + describe(data))
        return 0
    if args.cmd == "server":
        server = measure_jupyter_server()
        _merge(args.json, jupyter_server=server)
        print(f"Jupyter server: PSS {server['pss'] / GIB:.2f} GiB; browser tab: PSS "
              f"{server.get('browser', {}).get('pss', 0) / GIB:.2f} GiB", flush=True)
        return 0
    failed = []
    for path in args.notebooks:
        try:
            result = measure_notebook(path, args.cwd)
        except Exception as error:  # noqa: BLE001 - one notebook's failure must not stop the others
            print(f"{path.name}: not measured, {type(error).__name__}: {str(error)[-3000:]}", flush=True)
            failed.append(path.name)
            continue
        _merge(args.json, notebook=(path.name, result))  # after each notebook: a rerun can resume
        print(f"{path.name}: peak PSS {result['peak_pss'] / GIB:.2f} GiB, RSS sum "
              f"{result['peak_rss_sum'] / GIB:.2f} GiB, {result['most_ranks']} ranks, "
              f"{result['seconds']} s", flush=True)
    return 1 if failed else 0


def _merge(path: pathlib.Path, notebook: tuple[str, dict] | None = None, **fields) -> None:
    """Read the JSON again and write it with one notebook's or the server's numbers replaced."""
    data = json.loads(path.read_text()) if path.exists() else {}
    data.setdefault("notebooks", {})
    if notebook:
        data["notebooks"][notebook[0]] = notebook[1]
    data.update(fields, machine=machine(), date=datetime.date.today().isoformat(), sample_s=SAMPLE_S)
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def describe(data: dict) -> str:
    """One paragraph on how the table was measured, from the JSON."""
    m, server = data["machine"], data["jupyter_server"]
    return (f"Measured by `make notebook-memory` on {data['date']} ({m['cpu']}, {m['cores']} cores, "
            f"Python {m['python']}, torch {m['torch']}): each notebook runs top to bottom in a Jupyter "
            f"kernel while the kernel and every process below it (the forkserver, every rank, torchrun "
            f"and its workers) are sampled every {int(data['sample_s'] * 1000)} ms. The verdicts use "
            f"the peak of the summed PSS, which counts a page shared by n processes 1/n in each: the "
            f"ranks share torch's libraries (and the pages of the forkserver they are forked from), "
            f"which the RSS sum counts once per rank. Left free for the rest: the Jupyter server "
            f"({server['pss'] / GIB:.2f} GiB, measured), 1 GiB for the operating system of a "
            f"Codespace or Colab, and on a laptop 3 GiB for the desktop and other programs plus the "
            f"browser tab with JupyterLab open ({server['browser']['pss'] / GIB:.2f} GiB, measured in "
            f"headless Chromium); a \"GB\" machine is counted as 10^9 bytes.")


if __name__ == "__main__":
    sys.exit(main())

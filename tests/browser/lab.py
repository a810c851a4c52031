"""JupyterLab and headless Chromium for the browser tests, started and stopped by their own pids.

    with Lab(repo) as lab:          # copies notebooks/ and exercises/ to a temp dir and serves that
        with Browser() as browser:  # the system's Chromium, driven by playwright over CDP
            page = browser.new_page()
            page.goto(lab.url("notebooks/02_collectives.ipynb"))

JupyterLab listens on 127.0.0.1 with a random token, autosave off, and serves a COPY of the
notebooks (a test must never rewrite the committed ones). Its settings say what a reader on a
fresh clone has: no trust database (every notebook opens untrusted), no news or update checks
(no network). Every wait is bounded. On exit (also after a failure, a timeout or SIGTERM) each
process this module started is stopped by its own pid, with its descendants (the kernels and
their rank processes, Chromium's renderers), first politely, then with SIGKILL.
"""

from __future__ import annotations

import json
import os
import pathlib
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import psutil

CHROMIUM_CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
STARTED: list[subprocess.Popen] = []  # everything this module launched, for the last-resort cleanup

SETTINGS = {  # JupyterLab user settings: what a reader on a fresh clone sees, minus the network
    "@jupyterlab/docmanager-extension/plugin": {"autosave": False},
    "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification": {"checkForUpdates": False, "fetchNews": "false"},
    "@jupyterlab/extensionmanager-extension/plugin": {"enabled": False},
}


class BrowserTestError(RuntimeError):
    """The browser test could not run (no Chromium, JupyterLab did not start, ...)."""


def find_chromium() -> str:
    explicit = os.environ.get("COURSE_CHROMIUM")
    for name in ((explicit,) if explicit else CHROMIUM_CANDIDATES):
        path = shutil.which(name)
        if path:
            return path
    raise BrowserTestError(
        "no Chromium found (looked for " + (explicit or ", ".join(CHROMIUM_CANDIDATES)) + " on PATH). "
        "`make test-browser` installs Debian's `chromium` package with apt-get; elsewhere install "
        "Chromium and/or set COURSE_CHROMIUM to its executable.")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(what: str, predicate, timeout_s: float, interval_s: float = 0.2, proc=None):
    """Poll `predicate` until it returns a truthy value, at most `timeout_s` seconds."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = predicate()
        except Exception:  # not ready yet (connection refused, ...)
            value = None
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise BrowserTestError(f"{what}: the process exited with code {proc.returncode}")
        if time.monotonic() > deadline:
            raise BrowserTestError(f"{what}: not ready after {timeout_s:g} s")
        time.sleep(interval_s)


def stop(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """Stop `proc` and every descendant it has now, by pid: SIGTERM, then SIGKILL after grace_s."""
    if proc.poll() is not None and not psutil.pid_exists(proc.pid):
        return
    try:
        family = [psutil.Process(proc.pid)]
        family += family[0].children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    for p in family:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(family, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
    if proc in STARTED:
        STARTED.remove(proc)


def stop_all() -> None:
    for proc in list(STARTED)[::-1]:
        stop(proc, grace_s=3)


def _on_sigterm(signum, frame):  # `timeout` sends SIGTERM: unwind so every fixture's teardown runs
    raise KeyboardInterrupt(f"signal {signum}")


def install_signal_handlers() -> None:
    signal.signal(signal.SIGTERM, _on_sigterm)


class Lab:
    """JupyterLab on a copy of the repository's notebooks/ and exercises/."""

    def __init__(self, repo: pathlib.Path, notebooks: pathlib.Path | None = None, start_timeout_s: float = 90):
        self.repo, self.start_timeout_s = pathlib.Path(repo), start_timeout_s
        self.notebooks = pathlib.Path(notebooks) if notebooks else self.repo / "notebooks"
        self.token = secrets.token_hex(16)
        self.port = free_port()
        self.proc = None

    def url(self, path: str, workspace: str | None = None) -> str:
        """A fresh named workspace per page: nothing of an earlier page (open tabs) is restored."""
        workspace = workspace or secrets.token_hex(4)
        return f"http://127.0.0.1:{self.port}/lab/workspaces/{workspace}/tree/{path}?token={self.token}"

    def api(self, path: str, method: str = "GET", timeout_s: float = 10):
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/api/{path}", method=method,
                                     headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            body = r.read()
        return json.loads(body) if body else None

    def __enter__(self):
        self.tmp = pathlib.Path(tempfile.mkdtemp(prefix="course-browser-"))
        root = self.tmp / "root"
        for name, src in (("notebooks", self.notebooks), ("exercises", self.repo / "exercises")):
            shutil.copytree(src, root / name, ignore=shutil.ignore_patterns("__pycache__", "src"))
        for plugin, values in SETTINGS.items():
            path = self.tmp / "settings" / f"{plugin}.jupyterlab-settings"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(values))
        env = {k: v for k, v in os.environ.items() if k != "COURSE_GRADE_WITH"}  # learners run the stubs
        env.update(JUPYTER_DATA_DIR=str(self.tmp / "data"), JUPYTER_RUNTIME_DIR=str(self.tmp / "runtime"),
                   JUPYTER_CONFIG_DIR=str(self.tmp / "config"), COURSE_EXERCISES_DIR=str(root / "exercises"),
                   PYTHONUNBUFFERED="1")
        cmd = [str(pathlib.Path(sys.executable).parent / "jupyter"), "lab", "--no-browser",
               "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={self.port}", "--ServerApp.port_retries=0",
               f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={root}",
               f"--LabApp.user_settings_dir={self.tmp / 'settings'}",
               f"--LabApp.workspaces_dir={self.tmp / 'workspaces'}", "--LabApp.news_url=",
               "--ServerApp.shutdown_no_activity_timeout=900", "--MappingKernelManager.cull_idle_timeout=0",
               # kernels on Unix sockets beside their connection files, not five TCP ports picked free
               # and bound a second later, which a notebook's gloo ranks running beside (CI runs the
               # portability suite at the same time) can take first: the kernel then dies unstarted
               *(["--KernelManager.transport=ipc"] if os.name == "posix" else [])]
        if os.geteuid() == 0:
            cmd.append("--allow-root")
        self.log = open(self.tmp / "jupyterlab.log", "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=root,
                                     start_new_session=True)
        STARTED.append(self.proc)
        try:
            wait_until("JupyterLab", lambda: self.api("status", timeout_s=2), self.start_timeout_s, proc=self.proc)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join((self.tmp / "jupyterlab.log").read_text().splitlines()[-n:])
        except OSError:
            return ""

    def shutdown_kernels(self) -> None:
        """Shut every kernel down through the server (their rank processes stop with them), bounded."""
        try:
            for k in self.api("kernels", timeout_s=5) or []:
                self.api(f"kernels/{k['id']}", method="DELETE", timeout_s=15)
        except Exception:
            pass

    def __exit__(self, *exc):
        if self.proc is not None:
            self.shutdown_kernels()
            stop(self.proc)
            self.log.close()
        if not os.environ.get("COURSE_BROWSER_KEEP_TMP"):
            shutil.rmtree(self.tmp, ignore_errors=True)
        return False


class Browser:
    """The system Chromium, headless, launched by us (so we own its pid), driven over CDP."""

    def __init__(self, start_timeout_s: float = 60):
        self.start_timeout_s = start_timeout_s
        self.proc = self.pw = None

    def __enter__(self):
        from playwright.sync_api import sync_playwright

        exe = find_chromium()
        self.tmp = pathlib.Path(tempfile.mkdtemp(prefix="course-chromium-"))
        port = free_port()
        cmd = [exe, "--headless=new", f"--remote-debugging-port={port}", "--remote-debugging-address=127.0.0.1",
               f"--user-data-dir={self.tmp}", "--no-first-run", "--no-default-browser-check", "--disable-gpu",
               "--disable-dev-shm-usage", "--disable-extensions", "--disable-background-networking",
               "--disable-component-update", "--disable-sync", "--hide-scrollbars", "--mute-audio",
               "--force-device-scale-factor=1", "about:blank"]
        if os.geteuid() == 0:
            cmd.insert(1, "--no-sandbox")  # Chromium refuses to run its sandbox as root
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(self.tmp / "stderr.log", "w"),
                                     start_new_session=True)
        STARTED.append(self.proc)
        try:
            wait_until("Chromium's DevTools endpoint",
                       lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/json/version", timeout=2).read(),
                       self.start_timeout_s, proc=self.proc)
            self.pw = sync_playwright().start()
            self.browser = self.pw.chromium.connect_over_cdp(f"http://127.0.0.1:{port}",
                                                             timeout=self.start_timeout_s * 1000)
            self.context = self.browser.contexts[0] if self.browser.contexts else self.browser.new_context()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def new_page(self, width: int = 1400, height: int = 1000):
        page = self.context.new_page()
        page.set_viewport_size({"width": width, "height": height})
        page.set_default_timeout(30_000)
        return page

    def __exit__(self, *exc):
        try:
            if self.pw is not None:
                self.pw.stop()
        except Exception:
            pass
        if self.proc is not None:
            stop(self.proc, grace_s=5)
        shutil.rmtree(self.tmp, ignore_errors=True)
        return False

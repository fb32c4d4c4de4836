"""Several hosts on one machine for tests: a network namespace each, made
and removed by scripts/hosts.sh, so a prefill engine, a decode engine and a
router can each run on their own address, over a link with a rate that a
test can also cut and heal.

    with Hosts(["prefill", "decode", "router"], rate="250mbit") as hosts:
        server = hosts.popen("decode", [sys.executable, "-m", ...])
        hosts.run("prefill", ["curl", f"http://{hosts.addr('decode')}:8000/"])
        hosts.cut("decode")

The root namespace (this process) reaches every host at hosts.addr(...),
and the hosts reach it at hosts.gateway. Needs root; require_hosts() says
whether this machine can make namespaces. Standard library only, so that it
can be used outside pytest too."""

import atexit
import os
import signal
import subprocess
import threading
import unittest

SCRIPT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts", "hosts.sh"))

# hosts.sh up's exit statuses for "pick another and try again".
_SUBNET_TAKEN = 3
_NAME_TAKEN = 4

_lock = threading.Lock()
_counter = 0
_live = set()
_hooks_installed = False


def _script(*args, check=True):
    proc = subprocess.run(["bash", SCRIPT, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"hosts.sh {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def _base36_digit(n):
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    return digits[n % 36]


def _close_all():
    for hosts in list(_live):
        hosts.close()


def _on_sigterm(signum, frame, previous):
    _close_all()
    if callable(previous):
        previous(signum, frame)
        return
    if previous == signal.SIG_IGN:
        return
    # The default action kills the process without running atexit hooks;
    # the harness is already gone, so let it.
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _install_hooks():
    global _hooks_installed
    with _lock:
        if _hooks_installed:
            return
        _hooks_installed = True
    atexit.register(_close_all)
    # Only the main thread may set signal handlers; a harness made from
    # another thread still has atexit, and `hosts.sh clean` after SIGKILL.
    if threading.current_thread() is threading.main_thread():
        previous = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, lambda signum, frame: _on_sigterm(signum, frame, previous))


class Hosts:
    """Network namespaces NAME-HOST for each HOST, joined by one bridge.

    Made on construction, removed by close() (and by the with statement,
    at exit, and on SIGTERM). rate, if given, is applied to every host's
    link, e.g. "250mbit"."""

    def __init__(self, names, rate=None):
        names = list(names)
        if not names:
            raise ValueError("Hosts needs at least one host name")
        if len(set(names)) != len(names):
            raise ValueError(f"host names repeat: {names}")
        self.names = names
        self.closed = False
        self._index = {name: i + 1 for i, name in enumerate(names)}
        self._procs = []
        _install_hooks()
        # A run killed with SIGKILL leaves its harness behind; the next one
        # removes it.
        _script("clean")
        self.name, self.octet = self._up()
        with _lock:
            _live.add(self)
        try:
            if rate is not None:
                for name in names:
                    self.rate(name, rate)
        except BaseException:
            self.close()
            raise

    def _up(self):
        global _counter
        pid = os.getpid()
        last = None
        for _ in range(200):
            with _lock:
                counter = _counter
                _counter += 1
            name = f"kvf{pid:x}n{_base36_digit(counter)}"
            octet = 100 + (pid + counter) % 150
            proc = _script("up", name, str(octet), *self.names, check=False)
            if proc.returncode == 0:
                return name, octet
            last = proc
            if proc.returncode not in (_SUBNET_TAKEN, _NAME_TAKEN):
                break
        raise RuntimeError(f"hosts.sh up failed ({last.returncode}): {last.stderr.strip()}")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __repr__(self):
        return f"Hosts({self.name}, 10.{self.octet}.0.0/24, {self.names})"

    @property
    def gateway(self):
        """The root namespace's address on the hosts' bridge."""
        return f"10.{self.octet}.0.254"

    def _i(self, host):
        try:
            return self._index[host]
        except KeyError:
            raise KeyError(f"no host {host!r} in {self!r}") from None

    def addr(self, host):
        return f"10.{self.octet}.0.{self._i(host)}"

    def netns(self, host):
        self._i(host)
        return f"{self.name}-{host}"

    def prefix(self, host):
        """Put before a command to run it on host."""
        return ["ip", "netns", "exec", self.netns(host)]

    def popen(self, host, cmd, **kw):
        """subprocess.Popen of cmd (a list) on host; close() ends it if it
        still runs."""
        proc = subprocess.Popen(self.prefix(host) + list(cmd), **kw)
        self._procs.append(proc)
        return proc

    def run(self, host, cmd, **kw):
        """subprocess.run of cmd (a list) on host."""
        return subprocess.run(self.prefix(host) + list(cmd), **kw)

    def rate(self, host, rate):
        """Shape both directions of host's link to rate ("250mbit",
        "10gbit"); None or "off" removes the shaping."""
        self._i(host)
        _script("rate", self.name, host, "off" if rate is None else str(rate))

    def cut(self, host):
        """Take host's link down: nothing reaches it or leaves it."""
        self._i(host)
        _script("cut", self.name, host)

    def heal(self, host):
        """Bring host's link back; it carries traffic when this returns."""
        self._i(host)
        _script("heal", self.name, host)

    def close(self):
        """End what popen started, then remove the namespaces, links and
        bridge. Safe to call again."""
        if self.closed:
            return
        self.closed = True
        for proc in self._procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self._procs:
            try:
                proc.wait(timeout=3)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        try:
            _script("down", self.name)
        finally:
            with _lock:
                _live.discard(self)


def require_hosts():
    """Return if this machine can make hosts; otherwise skip the test when
    KVFERRY_SKIP_HOSTS=1, and fail it when not (CI runs as root, and a test
    run that silently skipped these would prove nothing)."""
    proc = subprocess.run(["bash", SCRIPT, "check"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode == 0:
        return
    lines = [line for line in proc.stdout.splitlines() if line.startswith("SKIPPED:")]
    reason = lines[0] if lines else f"SKIPPED: hosts.sh check failed: {proc.stdout.strip()}"
    if os.environ.get("KVFERRY_SKIP_HOSTS") == "1":
        try:
            import pytest
        except ImportError:
            raise unittest.SkipTest(reason) from None
        pytest.skip(reason, allow_module_level=True)
    raise RuntimeError(f"{reason} (set KVFERRY_SKIP_HOSTS=1 to skip tests that need hosts)")

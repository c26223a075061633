"""SIGINT and SIGTERM at any moment of a command — start-up imports, mid-conversion, mid-pack,
mid-unpack, mid-verify — stop it with one line on stderr (no traceback), exit 130 / 143, no temp
file left and a previous output intact (thinconv.launch, the console script's entry point)."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import BIN, assert_one_line_error, make_llama

pytestmark = pytest.mark.slow  # subprocesses converting a 420 MiB checkpoint

OLD = b"the previous output, which an interrupted run must leave as it was"


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> dict[str, Path]:
    """The big checkpoint (~420 MiB f32), its f32 archive and that archive's staging folder."""
    base = tmp_path_factory.mktemp("big")
    src = make_llama(base / "src", layers=32)
    archive = base / "big.thin"
    staging = base / "staging"
    for args in (["convert", src, archive, "--no-probe"], ["unpack", archive, staging]):
        r = subprocess.run([str(BIN), *map(str, args)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
    return {"src": src, "archive": archive, "staging": staging}


CONVERT = ["--dtype", "q4_0", "--no-probe"]


@pytest.fixture(scope="module")
def convert_seconds(big, tmp_path_factory) -> float:
    """How long an uninterrupted q4_0 conversion of the big checkpoint runs after the console script
    installed its handlers: later moments are fractions of it, so that the signal lands while the
    conversion runs on a fast machine as on a slow one."""
    out = tmp_path_factory.mktemp("timed") / "out.thin"
    proc = subprocess.Popen([str(BIN), "convert", str(big["src"]), str(out), *CONVERT],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not handler_installed(proc.pid, signal.SIGTERM) and proc.poll() is None:
        time.sleep(0.0005)
    start = time.monotonic()
    assert proc.wait(timeout=120) == 0
    return time.monotonic() - start


def handler_installed(pid: int, sig: int) -> bool:
    """Whether the process has a handler for `sig` (Linux: SigCgt in /proc/PID/status)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) & (1 << (sig - 1)))
    except FileNotFoundError:
        pass
    return False


def run_and_signal(args: list, sig: int, when, timeout: float = 120) -> tuple[subprocess.CompletedProcess, float]:
    """Start the console script, wait until `when(proc)` is true, send `sig`; the finished process
    and how long it took to stop after the signal."""
    env = {**os.environ, "COLUMNS": "200"}
    proc = subprocess.Popen([str(BIN), *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    try:
        deadline = time.monotonic() + timeout
        while not when(proc):
            assert proc.poll() is None, f"finished before the signal: {proc.communicate()}"
            assert time.monotonic() < deadline, "the moment to signal never came"
            time.sleep(0.0005)
        sent = time.monotonic()
        proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=timeout)
        stopped = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr), stopped


def after_handler(delay: float):
    """The moment `delay` s after the console script installed its handlers (its first statement).
    Python's own start-up installs a SIGINT handler; only thinconv's catches SIGTERM."""
    seen: dict[str, float] = {}

    def when(proc) -> bool:
        if "t" not in seen:
            if not handler_installed(proc.pid, signal.SIGTERM):
                return False
            seen["t"] = time.monotonic()
        return time.monotonic() - seen["t"] >= delay
    return when


def temp_appeared(pattern: str, delay: float = 0.0):
    """The moment `delay` s after a temp file or folder matching `pattern` appeared."""
    seen: dict[str, float] = {}

    def when(proc) -> bool:
        if "t" not in seen:
            if not glob.glob(pattern):
                return False
            seen["t"] = time.monotonic()
        return time.monotonic() - seen["t"] >= delay
    return when


def has_open(path: Path):
    """The moment the process has `path` open or mapped (verify is reading the archive)."""
    target = str(Path(path).resolve())

    def when(proc) -> bool:
        try:
            for fd in os.listdir(f"/proc/{proc.pid}/fd"):
                if os.readlink(f"/proc/{proc.pid}/fd/{fd}") == target:
                    return True
            with open(f"/proc/{proc.pid}/maps") as f:
                return any(line.rstrip("\n").endswith(target) for line in f)
        except (FileNotFoundError, ProcessLookupError):
            return False
    return when


def assert_stopped_cleanly(r: subprocess.CompletedProcess, sig: int, folder: Path, expected_files: list[str]) -> None:
    assert r.returncode == 128 + sig, (r.returncode, r.stderr)
    assert_one_line_error(r.stderr, f"interrupted by {signal.Signals(sig).name}")
    assert sorted(p.name for p in folder.iterdir()) == sorted(expected_files), "a temp file was left"


SIGNALS = [signal.SIGINT, signal.SIGTERM]
IDS = ["SIGINT", "SIGTERM"]


@pytest.mark.parametrize("sig", SIGNALS, ids=IDS)
@pytest.mark.parametrize("moment", ["0 s", "0.02 s", "0.1 s", "T/3", "2T/3"])
def test_signal_during_startup_or_early_is_one_line(big, convert_seconds, tmp_path, sig, moment):
    """From the console script's first statement on (0 s: typer, rich and numpy are still being
    imported) to two thirds of the conversion's run time T, a signal is one line and the exit code,
    never a traceback or an ImportError."""
    delay = float(moment[:-2]) if moment.endswith(" s") else convert_seconds * (2 if moment[0] == "2" else 1) / 3
    out = tmp_path / "out.thin"
    out.write_bytes(OLD)
    r, stopped = run_and_signal(["convert", big["src"], out, *CONVERT, "--force"], sig, after_handler(delay))
    assert_stopped_cleanly(r, sig, tmp_path, ["out.thin"])
    assert out.read_bytes() == OLD
    print(f"\n[signal] {signal.Signals(sig).name} {delay:.2f} s after the handler: exit {r.returncode}, "
          f"stopped in {stopped:.3f} s")


@pytest.mark.parametrize("sig", SIGNALS, ids=IDS)
@pytest.mark.parametrize("fraction", [0.0, 0.25])
def test_signal_mid_conversion_removes_the_temp_and_keeps_the_old_output(big, convert_seconds, tmp_path, sig,
                                                                         fraction):
    out = tmp_path / "out.thin"
    out.write_bytes(OLD)
    delay = fraction * convert_seconds
    r, stopped = run_and_signal(["convert", big["src"], out, *CONVERT, "--force"], sig,
                                temp_appeared(str(tmp_path / ".out.thin.*.tmp"), delay))
    assert_stopped_cleanly(r, sig, tmp_path, ["out.thin"])
    assert out.read_bytes() == OLD
    print(f"\n[signal] {signal.Signals(sig).name} {delay:.1f} s into the conversion: stopped in {stopped:.3f} s")


def test_sigterm_mid_conversion_without_force_leaves_nothing(big, convert_seconds, tmp_path):
    r, _ = run_and_signal(["convert", big["src"], tmp_path / "new.thin", *CONVERT],
                          signal.SIGTERM, temp_appeared(str(tmp_path / ".new.thin.*.tmp"), 0.2 * convert_seconds))
    assert_stopped_cleanly(r, signal.SIGTERM, tmp_path, [])


def test_sigterm_under_json_is_the_json_error_object(big, convert_seconds, tmp_path):
    r, _ = run_and_signal(["convert", big["src"], tmp_path / "new.thin", *CONVERT, "--json"],
                          signal.SIGTERM, temp_appeared(str(tmp_path / ".new.thin.*.tmp"), 0.2 * convert_seconds))
    assert r.returncode == 143 and r.stderr == "", r.stderr
    assert json.loads(r.stdout) == {"error": {"message": "interrupted by SIGTERM (no partial output is left behind)",
                                              "kind": "interrupted", "exit_code": 143}}
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("sig", SIGNALS, ids=IDS)
def test_signal_mid_pack(big, tmp_path, sig):
    out = tmp_path / "packed.thin"
    out.write_bytes(OLD)
    r, _ = run_and_signal(["pack", big["staging"], out, "--force"], sig,
                          temp_appeared(str(tmp_path / ".packed.thin.*.tmp")))
    assert_stopped_cleanly(r, sig, tmp_path, ["packed.thin"])
    assert out.read_bytes() == OLD


@pytest.mark.parametrize("sig", SIGNALS, ids=IDS)
def test_signal_mid_unpack(big, tmp_path, sig):
    r, _ = run_and_signal(["unpack", big["archive"], tmp_path / "dest"], sig,
                          temp_appeared(str(tmp_path / ".dest.*.tmp")))
    assert_stopped_cleanly(r, sig, tmp_path, [])


@pytest.mark.parametrize("sig", SIGNALS, ids=IDS)
def test_signal_during_verify(big, sig):
    r, _ = run_and_signal(["verify", big["archive"]], sig, has_open(big["archive"]))
    assert r.returncode == 128 + sig, r.stderr
    assert_one_line_error(r.stderr, f"interrupted by {signal.Signals(sig).name}")


def test_a_second_signal_does_not_cut_the_clean_up_short(big, tmp_path):
    """SIGINT then SIGTERM at once (Ctrl-C and a supervisor): the first one's clean-up completes."""
    out = tmp_path / "out.thin"

    def twice(proc) -> bool:
        if not glob.glob(str(tmp_path / ".out.thin.*.tmp")):
            return False
        proc.send_signal(signal.SIGINT)
        return True
    r, _ = run_and_signal(["convert", big["src"], out, *CONVERT], signal.SIGTERM, twice)
    assert_stopped_cleanly(r, signal.SIGINT, tmp_path, [])


def test_launch_is_the_console_script_and_imports_nothing_heavy():
    """The entry point installs its handlers before anything heavy is imported."""
    code = ("import sys, thinconv.launch; heavy = [m for m in ('numpy', 'typer', 'rich', 'thinconv.cli', "
            "'thinconv.format') if m in sys.modules]; print(heavy)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "[]", (r.stdout, r.stderr)
    assert "thinconv.launch" in BIN.read_text()


@pytest.mark.parametrize("moment", ["0.0", "0.3", "mid-run"])
def test_sigterm_to_a_batch_at_any_moment_is_one_line(big, tmp_path, moment):
    """Before the jobs file is read, while it is, or mid-run (the job's temp file is there): exit
    143 and one stderr line."""
    jobs = tmp_path / "jobs.toml"
    jobs.write_text(f'[[job]]\nsource = "{big["src"]}"\nout = "out.thin"\ndtype = "q4_0"\nprobe = false\n')
    when = temp_appeared(str(tmp_path / ".out.thin.*.tmp")) if moment == "mid-run" else after_handler(float(moment))
    r, _ = run_and_signal(["batch", jobs, "--workers", "1"], signal.SIGTERM, when)
    assert r.returncode == 143, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "interrupted by SIGTERM" in lines[0] or "stopped by a signal" in lines[0], lines
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left in (["jobs.toml"], ["jobs.toml", "out.thin"]), left  # no temp file
    if "out.thin" in left:  # the job had finished before the signal: its archive is whole
        import thinconv
        with thinconv.open(tmp_path / "out.thin") as a:
            assert a.verify().ok

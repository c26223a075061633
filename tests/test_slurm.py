"""The cluster examples of docs/batch.md, run for real and taken from the doc itself:

* the sbatch script, on a throwaway one-node Slurm cluster on 127.0.0.1 (tests/slurm_up.sh: its own
  slurm.conf, state and spool folders, munged, slurmctld and slurmd), under proctrack/linuxproc and
  proctrack/cgroup: an array over tiny checkpoints where every job runs once and every archive
  verifies; a task cancelled mid-conversion (exit 143, an `interrupted` report line, no temp file,
  no process left); a resubmission of some tasks that runs exactly the missing shards;
* the Kubernetes container command, as PID 1 of a new PID namespace, stopped by SIGTERM.

Skipped, with the reason, where Slurm (slurmctld, slurmd, munged, the client tools), root, a cgroup
v1 freezer hierarchy or `unshare` are missing. `.ci/run` installs the Debian packages."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import make_checkpoint
from thinconv import batch as B
from thinconv.format.reader import open_archive
from thinconv.recipe import load_registry

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent
DOC = HERE.parent / "docs" / "batch.md"
SLURM_UP = HERE / "slurm_up.sh"
SLURM_BINARIES = ("slurmctld", "slurmd", "munged", "mungekey", "sbatch", "squeue", "scancel", "scontrol", "sinfo")
SHARDS = 8  # the doc's array is 0-7


# ---------------------------------------------------------------- the doc's examples

def doc_blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", DOC.read_text(), flags=re.S | re.M)


def one_block(lang: str, needle: str) -> str:
    found = [b for b in doc_blocks(lang) if needle in b]
    assert len(found) == 1, f"docs/batch.md: expected one ```{lang} block with {needle!r}, found {len(found)}"
    return found[0]


def sbatch_script(hf_home: Path) -> str:
    """The doc's sbatch script, with its two site paths (shared HF cache, venv) pointed here."""
    text = one_block("sh", "#SBATCH --array=")
    for old, new in ((r"^export HF_HOME=.*$", f"export HF_HOME={hf_home}"),
                     (r"^\. \S+/bin/activate$", f". {sys.prefix}/bin/activate")):
        text, n = re.subn(old, new, text, flags=re.M)
        assert n == 1, f"docs/batch.md's sbatch script: no line {old!r} to point at this machine"
    assert re.search(r"^exec thinconv batch ", text, flags=re.M), text
    return text


def submit_commands() -> str:
    return one_block("sh", "mkdir -p logs")


def resubmit_command() -> str:
    return one_block("sh", "sbatch --array=1,3").strip()


def kubernetes_example() -> tuple[list[str], str, str]:
    """The container's command, its one argument and THINCONV_SHARDS, from the doc's Job."""
    text = one_block("yaml", "completionMode: Indexed")
    command = json.loads(re.search(r"^ +command: (\[.*\])$", text, flags=re.M).group(1))
    arg = re.search(r"^ +args:\n +- (.*)$", text, flags=re.M).group(1)
    shards = re.search(r"- name: THINCONV_SHARDS\n +value: \"(\d+)\"", text).group(1)
    return command, arg, shards


# ---------------------------------------------------------------- a slow conversion to interrupt

SLOW_TRANSFORM = '''
import os, time

def slow(rows, *, name, start, end, model):
    time.sleep(float(os.environ.get("SLOWTHIN_SECONDS", "0.25")))
    return rows
'''


def slow_plugin(folder: Path) -> dict[str, str]:
    """A transform package (an entry point) and a recipe `slowllama` sleeping on every weight page:
    a job with it and page_size 4KiB converts for ~5 s (0.25 s × ~40 pages over 2 threads), and a
    stop waits for at most the pages in flight."""
    plug = folder / "plug"
    info = plug / "slowthin-0.1.dist-info"
    info.mkdir(parents=True)
    (plug / "slowthin.py").write_text(SLOW_TRANSFORM)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: slowthin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[thinconv.transforms]\nslow = slowthin:slow\n")
    recipes = folder / "recipes"
    recipes.mkdir()
    (recipes / "slowllama.toml").write_text('name = "slowllama"\nextends = "llama"\n'
                                            'architectures = ["LlamaForCausalLM"]\n'
                                            '[transforms]\n"*.weight" = "slow"\n')
    path = os.pathsep.join(p for p in (str(plug), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "THINCONV_RECIPES": str(recipes), "SLOWTHIN_SECONDS": "0.25"}


def write_jobs(path: Path, jobs: list[dict]) -> Path:
    lines = ["[defaults]", "probe = false", 'recipe = "llama"']
    for job in jobs:
        lines.append("\n[[job]]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in job.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def temp_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


def wait_for(what: str, check, timeout: float, step: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(step)


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without any scheduler's variables (pytest may itself run in a Slurm job)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "SBATCH_", "SALLOC_", "SRUN_")) and
           k not in ("JOB_COMPLETION_INDEX", "THINCONV_SHARDS")}
    return {**env, "COLUMNS": "300", **extra}


# ---------------------------------------------------------------- a throwaway Slurm cluster

def which(name: str) -> str | None:
    return shutil.which(name) or next((str(p) for p in (Path("/usr/sbin") / name, Path("/sbin") / name)
                                       if os.access(p, os.X_OK)), None)


def cgroup_v1_freezer() -> str | None:
    """Why proctrack/cgroup cannot run here (Slurm 22.05's cgroup/v1 needs a writable freezer), or None."""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return "no /proc/mounts"
    if not any(m.split()[1] == "/sys/fs/cgroup/freezer" and m.split()[2] == "cgroup" for m in mounts
               if len(m.split()) > 2):
        return "proctrack/cgroup: no cgroup v1 freezer hierarchy at /sys/fs/cgroup/freezer (cgroup v2 only?)"
    if not os.access("/sys/fs/cgroup/freezer", os.W_OK):
        return "proctrack/cgroup: /sys/fs/cgroup/freezer is not writable"
    return None


class Slurm:
    def __init__(self, folder: Path, env: dict[str, str]):
        self.folder, self.env = folder, env

    def run(self, *args: str, cwd: Path | None = None, env: dict | None = None, check: bool = True) -> str:
        r = subprocess.run(list(args), capture_output=True, text=True, cwd=cwd, env={**self.env, **(env or {})},
                           timeout=60)
        if check and r.returncode != 0:
            raise AssertionError(f"{' '.join(args)}: exit {r.returncode}\n{r.stdout}{r.stderr}\n{self.logs()}")
        return r.stdout

    def queued(self, spec: str | None = None) -> bool:
        r = subprocess.run(["squeue", "-h", *(["-j", spec] if spec else [])], capture_output=True, text=True,
                           env=self.env, timeout=60)
        return r.returncode == 0 and bool(r.stdout.strip())  # a purged id exits 1: gone

    def wait_gone(self, spec: str | None = None, timeout: float = 90) -> float:
        t0 = time.monotonic()
        wait_for(f"Slurm job {spec or '(all)'} to end", lambda: not self.queued(spec), timeout)
        return time.monotonic() - t0

    def tasks(self, array_job: str) -> dict[int, dict[str, str]]:
        """Array task id → JobId, JobState, ExitCode (scontrol keeps ended jobs for MinJobAge)."""
        out = {}
        for line in self.run("scontrol", "show", "job", "-o", array_job).splitlines():
            f = dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
            out[int(f["ArrayTaskId"])] = {k: f[k] for k in ("JobId", "JobState", "ExitCode")}
        return out

    def logs(self) -> str:
        parts = []
        for f in sorted((self.folder / "log").glob("*.log")):
            parts.append(f"----- {f.name}\n" + "\n".join(f.read_text(errors="replace").splitlines()[-25:]))
        return "\n".join(parts)


@pytest.fixture(params=["linuxproc", "cgroup"])
def slurm(request):
    proctrack = request.param
    if sys.platform != "linux" or os.geteuid() != 0:
        pytest.skip("a throwaway Slurm cluster needs Linux and root (SlurmUser=root)")
    missing = [b for b in SLURM_BINARIES if which(b) is None]
    if missing:
        pytest.skip(f"Slurm not installed: no {', '.join(missing)} (Debian: apt-get install --no-install-recommends "
                    f"slurmctld slurmd slurm-client munge)")
    if proctrack == "cgroup" and (why := cgroup_v1_freezer()):
        pytest.skip(why)
    # unix sockets live under it (<= 108 bytes): a short folder in /tmp, not pytest's tmp_path
    folder = Path(tempfile.mkdtemp(prefix="slurm", dir="/tmp"))
    env = clean_env(SLURM_UP_PROCTRACK=proctrack, SLURM_UP_KILLWAIT="30",  # Slurm's default KillWait
                    # its own node name: proctrack/cgroup's freezer/slurm_<node> is shared by the whole machine
                    SLURM_UP_NODENAME=f"tc{os.getpid() % 100000}{folder.name[-4:].lower()}",
                    # the doc's --cpus-per-task=8 --mem=32G, 8 tasks at once on this small machine
                    SLURM_UP_CPUS=str(8 * SHARDS), SLURM_UP_MEMORY="65536",
                    PATH=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")
    t0 = time.monotonic()
    r = subprocess.run(["bash", str(SLURM_UP), str(folder)], capture_output=True, text=True, env=env, timeout=120)
    if r.returncode != 0:
        shutil.rmtree(folder, ignore_errors=True)
        pytest.fail(f"slurm_up.sh failed (exit {r.returncode}):\n{r.stdout}{r.stderr}")
    print(f"\n[{proctrack}] cluster up in {time.monotonic() - t0:.1f} s")
    conf = r.stdout.strip().rsplit("=", 1)[1]
    try:
        yield proctrack, Slurm(folder, {**env, "SLURM_CONF": conf})
    finally:
        subprocess.run(["bash", str(SLURM_UP), "--down", "--purge", str(folder)], capture_output=True, env=env,
                       timeout=120)


def job_processes(array_job: str, task: int) -> list[int]:
    """Live processes of an array task (Slurm puts these two variables in every job's environment)."""
    want = {f"SLURM_ARRAY_JOB_ID={array_job}".encode(), f"SLURM_ARRAY_TASK_ID={task}".encode()}
    pids = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            if want <= set((p / "environ").read_bytes().split(b"\0")) and \
                    (p / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                pids.append(int(p.name))
        except OSError:
            continue
    return pids


def submitted_id(stdout: str) -> str:
    m = re.search(r"Submitted batch job (\d+)", stdout)
    assert m, stdout
    return m.group(1)


def reports(work: Path) -> dict[int, list[dict]]:
    return {int(p.stem.split("-")[1]): [json.loads(ln) for ln in p.read_text().splitlines() if ln.strip()]
            for p in work.glob("report-*.jsonl")}


@pytest.fixture(scope="module")
def llama2(tmp_path_factory) -> Path:
    """One tiny checkpoint (the `ckpts` fixture would build all six)."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    return make_checkpoint("llama2", tmp_path_factory.mktemp("ckpt") / "llama2").path


# ---------------------------------------------------------------- the test

def test_the_docs_sbatch_script_on_a_real_slurm(slurm, llama2, tmp_path):
    proctrack, cluster = slurm
    t_start = time.monotonic()
    work = tmp_path / "zoo"
    (work / "out").mkdir(parents=True)
    src = str(llama2)
    # eight jobs on one source: equal sizes, so shard k of 8 gets job k + 1; job 4 (shard 3) is slow
    variants = [{"dtype": "bf16"}, {"dtype": "f16"}, {"dtype": "q8_0"},
                {"recipe": "slowllama", "page_size": "4KiB"}, {"dtype": "q4_0"}, {"dtype": "q4_1"},
                {"dtype": "f32"}, {"dtype": "q8_0", "rope_layout": "interleaved"}]
    jobs_file = write_jobs(work / "jobs.toml", [{"source": src, "out": f"out/j{k}.thin", **v}
                                                 for k, v in enumerate(variants, 1)])
    plugin = slow_plugin(tmp_path)
    jobs = B.load_jobs(jobs_file, registry=load_registry([plugin["THINCONV_RECIPES"]]))
    owner = {j.index: s for s in range(SHARDS) for j in B.shard_jobs(jobs, s, SHARDS)}
    assert owner == {k: k - 1 for k in range(1, 9)}
    SLOW, SLOW_TASK, CORRUPT, CORRUPT_TASK = 4, 3, 2, 1  # the doc resubmits --array=1,3
    out = work / "out"
    script = sbatch_script(tmp_path / "hf")
    assert f"#SBATCH --array=0-{SHARDS - 1}\n" in script and f"THINCONV_SHARDS={SHARDS} " in resubmit_command()
    (work / "zoo.sbatch").write_text(script)
    env = {**plugin}

    # 1. the doc's submission, verbatim: mkdir -p logs; sbatch zoo.sbatch
    t0 = time.monotonic()
    array = submitted_id(cluster.run("bash", "-ec", submit_commands(), cwd=work, env=env))

    # 2. scancel the task running the slow job once its temp file exists (mid-conversion)
    wait_for("the slow job's temp file", lambda: any(n.startswith(f".j{SLOW}.thin.") for n in temp_files(out)), 120,
             step=0.02)
    t_tmp = time.monotonic() - t0
    pids = job_processes(array, SLOW_TASK)
    assert pids, "no process of the task converting the slow job"
    cluster.run("scancel", f"{array}_{SLOW_TASK}")
    stop_seconds = cluster.wait_gone(f"{array}_{SLOW_TASK}")
    # Slurm says the task is over: then thinconv is over too, its temp file gone, its report written
    assert job_processes(array, SLOW_TASK) == [], "a process of the cancelled task outlived it"
    assert not any(n.startswith(f".j{SLOW}.thin.") for n in temp_files(out)), temp_files(out)
    slow_report = reports(work)[SLOW_TASK]
    assert [(r["job"], r["status"], r["error"]) for r in slow_report] == [(SLOW, "failed", "interrupted")]
    log = (work / "logs" / f"thin-zoo-{SLOW_TASK}.log").read_text()
    assert "stopped by a signal" in log and "Traceback" not in log, log
    assert not (out / f"j{SLOW}.thin").exists()

    # 3. the rest of the array: every other job ran once, in its own shard, and verifies
    cluster.wait_gone(array)
    t_array = time.monotonic() - t0
    tasks = cluster.tasks(array)
    assert sorted(tasks) == list(range(SHARDS))
    cancelled = tasks.pop(SLOW_TASK)
    assert (cancelled["JobState"], cancelled["ExitCode"]) == ("CANCELLED", "143:0"), cancelled  # 143: thinconv's own
    assert {(t["JobState"], t["ExitCode"]) for t in tasks.values()} == {("COMPLETED", "0:0")}, tasks
    recs = reports(work)
    assert sorted(recs) == list(range(SHARDS))
    for task, lines in recs.items():
        assert [r["job"] for r in lines] == [task + 1], (task, lines)
        assert task == SLOW_TASK or lines[0]["status"] == "done", lines
    starts = [m for t in range(SHARDS) for m in re.findall(r"^job (\d+) start:", (work / "logs" /
                                                                                  f"thin-zoo-{t}.log").read_text(),
                                                          flags=re.M)]
    assert sorted(map(int, starts)) == list(range(1, 9))  # each job started exactly once
    for k in range(1, 9):
        if k != SLOW:
            with open_archive(out / f"j{k}.thin") as a:
                assert a.verify().ok
    assert temp_files(out) == []

    # 4. one more shard goes missing: job 2's archive is corrupted on disk
    data = bytearray((out / f"j{CORRUPT}.thin").read_bytes())
    data[-100] ^= 0xFF  # a page byte: the manifest still matches, a checksum does not
    (out / f"j{CORRUPT}.thin").write_bytes(bytes(data))
    before = {p.name: p.stat().st_mtime_ns for p in [*out.iterdir(), *work.glob("report-*"), *work.glob("logs/*")]}

    # 5. resubmitting tasks 1 and 3 without the count: they stop at once, saying what to set
    t1 = time.monotonic()
    if proctrack == "linuxproc":  # (once is enough)
        again = submitted_id(cluster.run("sbatch", "--array=1,3", "zoo.sbatch", cwd=work, env=env))
        cluster.wait_gone(again)
        tasks = cluster.tasks(again)
        assert {t: (v["JobState"], v["ExitCode"]) for t, v in tasks.items()} == {1: ("FAILED", "2:0"),
                                                                                 3: ("FAILED", "2:0")}
        for t in (1, 3):
            lines = [ln for ln in (work / "logs" / f"thin-zoo-{t}.log").read_text().splitlines() if ln.strip()]
            assert len(lines) == 1 and lines[0].startswith("error: --shard auto: this Slurm array "
                                                           "(MIN=1 MAX=3 STEP=1 COUNT=2) is not the whole range"), lines
            assert "THINCONV_SHARDS" in lines[0]
        assert {p.name: p.stat().st_mtime_ns for p in [*out.iterdir(), *work.glob("report-*")]} == \
            {k: v for k, v in before.items() if not k.startswith("thin-zoo-")}
    t_ambiguous = time.monotonic() - t1

    # 6. the doc's resubmission, verbatim: exactly the missing shards run (1/8 and 3/8)
    t2 = time.monotonic()
    again = submitted_id(cluster.run("bash", "-ec", resubmit_command(), cwd=work, env={**env, "SLOWTHIN_SECONDS": "0"}))
    cluster.wait_gone(again)
    t_resubmit = time.monotonic() - t2
    tasks = cluster.tasks(again)
    assert {t: (v["JobState"], v["ExitCode"]) for t, v in tasks.items()} == {1: ("COMPLETED", "0:0"),
                                                                             3: ("COMPLETED", "0:0")}
    recs = reports(work)
    assert [(r["job"], r["status"]) for r in recs[CORRUPT_TASK]] == [(CORRUPT, "done")]
    assert [(r["job"], r["status"]) for r in recs[SLOW_TASK]] == [(SLOW, "done")]
    log1 = (work / "logs" / f"thin-zoo-{CORRUPT_TASK}.log").read_text()
    assert f"shard {CORRUPT_TASK}/8 (Slurm array task {CORRUPT_TASK}, 8 shards from $THINCONV_SHARDS): 1 of 8 jobs" \
        in log1, log1
    assert re.search(rf"^job {CORRUPT} start: .*\(up to date: verifying it\)\njob {CORRUPT} redo: archive fails "
                     rf"verification: page '[^']+' at offset \d+: checksum mismatch", log1, flags=re.M), log1
    after = {p.name: p.stat().st_mtime_ns for p in [*out.iterdir(), *work.glob("report-*"), *work.glob("logs/*")]}
    changed = sorted(k for k in after if after[k] != before.get(k))
    assert changed == sorted([f"j{CORRUPT}.thin", f"j{SLOW}.thin", f"report-{CORRUPT_TASK}.jsonl",
                              f"report-{SLOW_TASK}.jsonl", f"thin-zoo-{CORRUPT_TASK}.log",
                              f"thin-zoo-{SLOW_TASK}.log"]), changed
    for k in range(1, 9):
        with open_archive(out / f"j{k}.thin") as a:
            assert a.verify().ok
    assert temp_files(out) == []
    print(f"[{proctrack}] temp file of the slow job after {t_tmp:.1f} s; scancel → task gone in {stop_seconds:.2f} s "
          f"(ExitCode {cancelled['ExitCode']}); array done in {t_array:.1f} s; ambiguous resubmission "
          f"{t_ambiguous:.1f} s; resubmission {t_resubmit:.1f} s; test {time.monotonic() - t_start:.1f} s")


# ---------------------------------------------------------------- Kubernetes: PID 1 of a container

@pytest.fixture
def unshare() -> str:
    """unshare(1), able to start a process as PID 1 of a new PID namespace (as a container's)."""
    found = shutil.which("unshare")
    if sys.platform != "linux" or os.geteuid() != 0 or found is None:
        pytest.skip("needs Linux, root and unshare(1) for a new PID namespace")
    probe = subprocess.run([found, "--pid", "--fork", "--mount-proc", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"unshare --pid --fork --mount-proc does not work here: {probe.stderr.strip()}")
    return found


def test_the_docs_kubernetes_command_stops_cleanly_as_pid_1(unshare, llama2, tmp_path):
    """The container's `sh -c 'exec thinconv batch …'` as PID 1 of a new PID namespace (what a pod's
    container is), SIGTERMed mid-conversion as a pod deletion does: exit 143, `interrupted` in the
    report, no temp file. (A plain `sh -c 'thinconv …'` as PID 1 ignores the SIGTERM.)"""
    command, arg, shards = kubernetes_example()
    assert arg.startswith("exec thinconv batch "), arg
    zoo = tmp_path / "zoo"
    (zoo / "reports").mkdir(parents=True)
    (zoo / "out").mkdir()
    src = str(llama2)
    # equal sizes: shard 0 of the doc's 8 gets job 1 (slow), shard 1 job 2
    write_jobs(zoo / "jobs.toml", [{"source": src, "out": "out/slow.thin", "recipe": "slowllama", "page_size": "4KiB"},
                                   {"source": src, "out": "out/fast.thin"}])
    arg_here = arg.replace("/zoo/", f"{zoo}/")
    assert arg_here.count(str(zoo)) == 2, arg_here
    env = clean_env(**slow_plugin(tmp_path), JOB_COMPLETION_INDEX="0", THINCONV_SHARDS=shards,
                    HF_HOME=str(zoo / "hf"), PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    proc = subprocess.Popen([unshare, "--pid", "--fork", "--mount-proc", *command, arg_here], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        pid1 = int(wait_for("the namespace's PID 1", lambda: Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
                            .read_text().split(), 30)[0])
        wait_for("the slow job's temp file", lambda: temp_files(zoo / "out"), 120, step=0.02)
        status = Path(f"/proc/{pid1}/status").read_text()
        assert re.search(r"^NSpid:\s+\d+\s+1$", status, flags=re.M), status  # PID 1 in its namespace
        assert b"thinconv" in Path(f"/proc/{pid1}/cmdline").read_bytes()  # sh exec'ed it
        t0 = time.monotonic()
        os.kill(pid1, signal.SIGTERM)  # what the kubelet does on pod deletion
        try:
            output, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            raise AssertionError("SIGTERM did not stop the container's PID 1 within 30 s") from None
        stop = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 143, output
    assert "shard 0/8 (Kubernetes completion index 0, 8 shards from $THINCONV_SHARDS): 1 of 2 jobs" in output, output
    assert "stopped by a signal" in output and "Traceback" not in output, output
    lines = [json.loads(ln) for ln in (zoo / "reports" / "report-0.jsonl").read_text().splitlines()]
    assert [(r["job"], r["status"], r["error"]) for r in lines] == [(1, "failed", "interrupted")]
    assert sorted(p.name for p in (zoo / "out").iterdir()) == []  # no temp file, no partial archive
    print(f"\n[kubernetes] PID 1 stopped {stop:.2f} s after SIGTERM, exit {proc.returncode}")

"""What the two fuzzers share: running one case in-process under a time and memory watch, and the
tally they print (rejected cleanly / accepted / crashed / over time / over memory).

A case is "rejected cleanly" when it raises one of thinconv's named errors (ThinError) or reports
itself invalid; "crashed" when anything else escapes (a traceback for a user). Peak memory per case
is the growth of the process's peak RSS (VmHWM, reset before each case through
/proc/self/clear_refs); time is wall time, with a hard stop (SIGALRM) well past the limit.
"""

from __future__ import annotations

import argparse
import os
import resource
import signal
import sys
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from thinconv.errors import MAX_LINE, MAX_MESSAGE, ThinError  # noqa: E402

TIME_LIMIT = 5.0  # seconds per case
MEMORY_LIMIT = 500 * 2**20  # bytes of peak RSS growth per case
HARD_STOP = 30  # seconds: SIGALRM ends a runaway case (counted over time)
ADDRESS_SPACE = 8 * 2**30  # RLIMIT_AS for the fuzzing process: a runaway allocation fails, not the host


class _HardStop(BaseException):
    pass


@dataclass
class Tally:
    counts: Counter = field(default_factory=Counter)
    crashes: list[str] = field(default_factory=list)
    slow: list[str] = field(default_factory=list)
    heavy: list[str] = field(default_factory=list)
    long_messages: list[str] = field(default_factory=list)
    multi_line: list[str] = field(default_factory=list)
    longest: int = 0  # characters of the longest message
    longest_case: str = ""
    max_seconds: float = 0.0
    max_rss_growth: int = 0
    elapsed: float = 0.0

    @property
    def cases(self) -> int:
        return self.counts["rejected"] + self.counts["accepted"] + self.counts["crashed"]

    @property
    def failed(self) -> int:
        """Cases that missed the target: crashed, over time or over memory."""
        return self.counts["crashed"] + self.counts["over_time"] + self.counts["over_memory"]

    def progress(self, done: int, t0: float, every: int) -> None:
        """A progress line every `every` cases (0: never)."""
        if every and done % every == 0:
            print(f"  … {done} cases, {self.counts['crashed']} crashed, {time.perf_counter() - t0:.0f} s", flush=True)

    def lines(self, what: str) -> list[str]:
        c = self.counts
        out = [f"{what}: {self.cases} cases in {self.elapsed:.1f} s ({self.cases / max(self.elapsed, 1e-9):.0f}/s)",
               f"  rejected cleanly {c['rejected']}",
               f"  accepted         {c['accepted']}",
               f"  crashed          {c['crashed']}",
               f"  over time        {c['over_time']} (> {TIME_LIMIT:g} s; slowest {self.max_seconds:.2f} s)",
               f"  over memory      {c['over_memory']} (> {MEMORY_LIMIT // 2**20} MB; largest growth "
               f"{self.max_rss_growth / 2**20:.0f} MB)",
               f"  messages > {MAX_MESSAGE} chars {len(self.long_messages)} (longest {self.longest}; the CLI cuts "
               f"lines beyond {MAX_LINE}); with a newline {len(self.multi_line)}"]
        for title, items in (("crash", self.crashes), ("slow", self.slow), ("heavy", self.heavy),
                             ("long message", self.long_messages[:2] + [f"longest: {self.longest_case}"]),
                             ("newline", self.multi_line[:3])):
            out += [f"  {title}: {x}" for x in items[:10]]
        return out


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux ≥ 4.0)
    except OSError:
        pass


def limit_address_space() -> None:
    """Cap this process's address space, so that an allocation sized by a hostile field fails (and is
    counted as a crash) instead of taking the host's memory."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY or soft > ADDRESS_SPACE:
        resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, hard))


def main(name: str, doc: str, fuzz: Callable[[int, int, int], Tally]) -> int:
    """A fuzzer's command line: --cases, --seed, --progress; prints the tally; exit 1 when a case
    missed the target."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--cases", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--progress", type=int, default=0, help="print a line every N cases")
    args = p.parse_args()
    limit_address_space()
    tally = fuzz(args.cases, args.seed, args.progress)
    print("\n".join(tally.lines(name)))
    return 1 if tally.failed else 0


def run_case(tally: Tally, label: str, case: Callable[[], bool]) -> None:
    """Run `case` (returns True when the input was accepted, False when it reported itself invalid;
    raises ThinError when rejected) and record the outcome."""

    def alarm(signum, frame):
        raise _HardStop()

    old = signal.signal(signal.SIGALRM, alarm)
    _reset_peak()
    base = _current_rss()
    t0 = time.perf_counter()
    signal.alarm(HARD_STOP)
    try:
        accepted = case()
        tally.counts["accepted" if accepted else "rejected"] += 1
    except ThinError as e:
        tally.counts["rejected"] += 1
        text = str(e)
        if len(text) > tally.longest:
            tally.longest, tally.longest_case = len(text), f"{label}: {text[:150]!r}"
        if "\n" in text:
            tally.multi_line.append(f"{label}: {text[:200]!r}")
        elif len(text) > MAX_MESSAGE:
            tally.long_messages.append(f"{label}: {len(text)} chars: {text[:150]!r}")
    except _HardStop:
        tally.counts["crashed"] += 1
        tally.crashes.append(f"{label}: stopped after {HARD_STOP} s")
    except (Exception, RecursionError) as e:  # anything else is a traceback for a user
        tally.counts["crashed"] += 1
        where = traceback.extract_tb(e.__traceback__)[-1]
        tally.crashes.append(f"{label}: {type(e).__name__}: {str(e)[:200]} "
                             f"({Path(where.filename).name}:{where.lineno})")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    seconds = time.perf_counter() - t0
    growth = max(0, _peak_rss() - base)
    tally.max_seconds = max(tally.max_seconds, seconds)
    tally.max_rss_growth = max(tally.max_rss_growth, growth)
    if seconds > TIME_LIMIT:
        tally.counts["over_time"] += 1
        tally.slow.append(f"{label}: {seconds:.1f} s")
    if growth > MEMORY_LIMIT:
        tally.counts["over_memory"] += 1
        tally.heavy.append(f"{label}: {growth / 2**20:.0f} MB")


# Values a hostile edit puts in a field: boundaries, huge and tiny numbers, wrong types.
INTERESTING = [0, 1, -1, 2, 3, 7, 8, 31, 32, 33, 64, 255, 256, 4095, 4096, 4097, 65535, 65536, 2**31 - 1, 2**31,
               2**32, 2**53, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 10**9, 10**12, 10**19, -(2**63),
               0.0, -0.0, 0.5, 1.0, 1.5, -1.0, 1e-300, 5e-324, 1e-45, 1e38, 3.5e38, 1e300, 1.7976931348623157e308,
               -1e308, 1e-5, 10000.0, True, False, None, "", "x", "yarn", "linear", "llama3", "dynamic", "longrope",
               "default", "f32", "bf16", "q8_0", "rmsnorm", "layernorm", "full", "sliding", "half", "interleaved",
               "F32", "BF16", "I64", "F8_E4M3", "BOOL", [], [0], [1], [2**63], [1, 1], [-1], ["x"], [[1]], {},
               {"type": "yarn"}, {"a": 1}, "9" * 25, "Qwen2ForCausalLM", ["LlamaForCausalLM"], ["LlamaForCausalLM"] * 3]

# Raw JSON number spellings the strict parser must refuse or bound (not representable as objects).
RAW_NUMBERS = [b"1e400", b"-1e400", b"9" * 4299, b"9" * 21, b"NaN", b"Infinity", b"-Infinity", b"1e-400",
               b"0." + b"0" * 5000 + b"1", b"18446744073709551616"]

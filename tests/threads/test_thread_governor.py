"""The thread governor walked through quiet, collapse, lasting contention, recovery and a lucky probe, with its
state asserted after each step; and torch.set_num_threads from the engine thread really governing that thread's
parallel regions (CPU time of the other threads), switched back and forth at run time."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch
from support.engines import make_engine, req, tokens_of
from support.paths import ROOT

from service import metrics
from service.config import Settings
from service.cpu_budget import OtherLoad
from service.engine.thread_governor import ThreadControl, ThreadGovernor, step_key

KEY = step_key(32, False)


def feed(gov: ThreadGovernor, rate: float, steps: int = 1, key: object = KEY, rows: int = 32) -> None:
    """``steps`` decode steps at the governor's choice, each at ``rate`` rows/s."""
    for _ in range(steps):
        gov.record(key, gov.choose(key), rows / rate, rows)


def test_levels_and_arguments() -> None:
    assert ThreadGovernor(8).levels == (8, 4, 2, 1)
    assert ThreadGovernor(3).levels == (3, 1)
    assert ThreadGovernor(1).levels == (1,)
    assert step_key(32, False) == step_key(17, False) != step_key(16, False) != step_key(16, True)
    for bad in ({"max_threads": 0}, {"probe_every": 1}, {"probe_every": 900}, {"drop": 1.0}, {"margin": -1}):
        with pytest.raises(ValueError):
            ThreadGovernor(**{"max_threads": 2, **bad})  # type: ignore[arg-type]


def test_quiet_keeps_all_threads_and_probes_one_step_down() -> None:
    gov = ThreadGovernor(2, probe_every=10)
    feed(gov, 1000.0, 9)
    assert (gov.current, gov.choose(KEY)) == (2, 2)
    feed(gov, 1000.0)  # the 10th step: the next one is a probe with fewer threads
    assert gov.choose(KEY) == 1
    gov.record(KEY, 1, 32 / 650.0, 32)  # one thread is slower: stay
    assert (gov.current, gov.choose(KEY), gov.switches) == (2, 2, 0)
    assert gov.estimate(KEY, 1) == pytest.approx(650.0) and gov.estimate(KEY, 2) == pytest.approx(1000.0)
    assert gov.interval == 20  # a probe that loses makes the next one rarer: on a quiet machine they are cost
    for _ in range(6):
        while gov.choose(KEY) == 2:
            feed(gov, 1000.0)
        gov.record(KEY, 1, 32 / 650.0, 32)
    assert (gov.current, gov.interval) == (2, gov.max_probe_every)


def test_a_hint_down_is_checked_by_a_probe_up_soon() -> None:
    gov = ThreadGovernor(2, min_samples=4, probe_every=50, max_probe_every=800)
    gov.interval = 800  # probes kept losing earlier (a neighbour came and went)
    feed(gov, 1000.0, 10)
    gov.hint(1)  # after an idle spell the window saw a client's burst, not a neighbour
    assert gov.current == 1
    feed(gov, 600.0, 4)
    assert gov.choose(KEY) == 2  # the check, after min_samples steps, not after 800
    feed(gov, 1000.0)
    assert gov.current == 2  # the guess was wrong: back at two threads after five steps
    gov.hint(1)  # a real neighbour this time: the check loses, and the next probe waits longer
    feed(gov, 600.0, 4)
    gov.record(KEY, 2, 32 / 200.0, 32)
    assert gov.current == 1 and gov.interval == 100
    gov.hint(2)
    assert gov.current == 2 and gov.choose(KEY) == 2  # a hint up is trusted: no probe scheduled


def test_a_lone_slow_step_is_an_outlier_neither_averaged_in_nor_acted_on() -> None:
    gov = ThreadGovernor(2, min_samples=4, probe_every=50)
    feed(gov, 1000.0, 5)
    for _ in range(3):  # a client's burst at each request's start: one step in a dozen 3x slower
        feed(gov, 330.0)
        feed(gov, 1000.0, 11)
    assert (gov.current, gov.choose(KEY), gov.switches) == (2, 2, 0)
    assert gov.estimate(KEY, 2) == pytest.approx(1000.0)
    feed(gov, 330.0, 2)  # two in a row: the machine changed
    assert gov.estimate(KEY, 2) == pytest.approx(330.0) and gov.choose(KEY) == 1


def test_a_collapse_drops_a_thread_after_two_steps_and_lasting_contention_makes_probes_up_rare() -> None:
    gov = ThreadGovernor(2, min_samples=4, probe_every=10, max_probe_every=40)
    feed(gov, 1000.0, 5)
    feed(gov, 60.0)  # a neighbour took a core: one step 16x slower, an outlier so far
    assert gov.choose(KEY) == 2 and gov.estimate(KEY, 2) == pytest.approx(1000.0)
    feed(gov, 60.0)  # and the next: a collapse
    assert gov.estimate(KEY, 2) == pytest.approx(60.0)  # replaced, not averaged into the quiet figure
    assert gov.choose(KEY) == 1
    feed(gov, 600.0)  # the probe with one thread
    assert (gov.current, gov.switches) == (1, 1)
    intervals = []
    for _ in range(4):  # probes up keep losing while the neighbour stays
        steps = 0
        while gov.choose(KEY) == 1:
            feed(gov, 600.0)
            steps += 1
        intervals.append(steps)
        gov.record(KEY, 2, 32 / 60.0, 32)
        assert gov.current == 1
    assert intervals == [10, 20, 40, 40]


def test_the_end_of_contention_is_noticed_and_a_lucky_probe_costs_two_steps() -> None:
    gov = ThreadGovernor(2, min_samples=4, probe_every=10)
    feed(gov, 1000.0, 5)
    feed(gov, 60.0, 2)
    feed(gov, 600.0)
    assert gov.current == 1
    # a lucky probe: the neighbour was off the CPU for that one step
    feed(gov, 600.0, 10)
    assert gov.choose(KEY) == 2
    feed(gov, 950.0)
    assert (gov.current, gov.switches) == (2, 2)
    feed(gov, 60.0)  # the trial: one step below one thread's 600 may be an outlier
    assert gov.current == 2
    feed(gov, 60.0)  # two in a row: back
    assert (gov.current, gov.switches) == (1, 3)
    # the neighbour leaves: the next probe up wins and the interval starts over
    while gov.choose(KEY) == 1:
        feed(gov, 610.0)
    feed(gov, 1000.0)
    assert (gov.current, gov.interval) == (2, 10)
    feed(gov, 1000.0, 4)
    assert gov.current == 2


def test_a_new_keys_cold_first_step_decides_nothing() -> None:
    """A batch size's first step runs cold (about 20x slower at a fresh server's first request): a probe due then
    waits until that key's estimate is settled, and a probe step of a key without one gives no verdict."""
    gov = ThreadGovernor(2, min_samples=4, probe_every=10)
    small = step_key(1, False)
    feed(gov, 1000.0, 9)
    feed(gov, 7.6, key=small, rows=1)  # the 10th step: a probe is due, but batch 1 has one cold sample
    assert gov.choose(small) == 2
    feed(gov, 150.0, 3, key=small, rows=1)  # settled: now the probe
    assert gov.choose(small) == 1
    feed(gov, 64.0, key=small, rows=1)  # one thread is slower than batch 1's settled estimate: stay
    assert (gov.current, gov.switches) == (2, 0)
    fresh = ThreadGovernor(2, min_samples=4, probe_every=10)
    feed(fresh, 1000.0, 10)  # a probe is due: the next step tries one thread
    assert fresh.choose(KEY) == 1
    feed(fresh, 900.0, key=step_key(2, False), rows=2)  # but the next step is of a batch size never seen
    assert (fresh.current, fresh.switches, fresh.interval) == (2, 0, 10)  # no verdict either way


def test_the_level_is_global_and_estimates_are_per_key() -> None:
    gov = ThreadGovernor(4, min_samples=2, probe_every=50)
    small = step_key(1, False)
    feed(gov, 1000.0, 3)
    feed(gov, 30.0, 3, key=small, rows=1)
    feed(gov, 100.0, 2)  # batch 32 collapses: probe 2
    assert gov.choose(KEY) == 2
    feed(gov, 700.0)
    assert gov.current == 2 and gov.choose(small) == 2  # the batch-1 steps follow
    assert gov.estimate(small, 4) == pytest.approx(30.0) and gov.estimate(small, 2) is None


def _other_threads_cpu() -> float:
    """CPU seconds of every thread of this process but the caller (utime + stime from /proc)."""
    me, total = threading.get_native_id(), 0
    for tid in os.listdir("/proc/self/task"):
        if int(tid) == me:
            continue
        try:
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def _walk_to(control: ThreadControl, want: int) -> None:
    """Drive the real governor to ``want`` threads: a collapse with 2, or a probe up that wins."""
    if want == 1:
        control.after_step(KEY, 2, 32 / 60.0, 32)  # a collapse: two slow steps in a row
        control.after_step(KEY, 2, 32 / 60.0, 32)
        assert control.before_step(KEY) == 1  # the probe
        control.after_step(KEY, 1, 32 / 600.0, 32)  # wins
    else:
        while control.before_step(KEY) == 1:
            control.after_step(KEY, 1, 32 / 600.0, 32)
        control.after_step(KEY, 2, 32 / 1000.0, 32)  # the probe up wins
    assert control.before_step(KEY) == want


def test_the_engine_threads_count_governs_its_own_parallel_regions() -> None:
    """Switched at run time on a non-main thread (as the engine does), the count changes who does the work."""
    a = torch.randn(384, 384)
    shares: list[float] = []

    def work() -> None:
        control = ThreadControl(Settings(threads=2))
        control.others = None  # measured switches only: no hint from what the rest of this busy machine does
        control.start()
        for want in (2, 1, 2):
            if want != control.threads:
                _walk_to(control, want)
            assert torch.get_num_threads() == want == control.threads
            others, mine = _other_threads_cpu(), time.thread_time()
            while time.thread_time() - mine < 0.4:
                for _ in range(20):
                    a @ a
            shares.append((_other_threads_cpu() - others) / (time.thread_time() - mine))
            for _ in range(5):  # settled quiet figures at this count
                control.after_step(KEY, want, 32 / (1000.0 if want == 2 else 600.0), 32)

    t = threading.Thread(target=work)
    t.start()
    t.join(120)
    assert len(shares) == 3, "the worker thread failed"
    assert shares[0] > 0.3 and shares[2] > 0.3  # a second thread did a good part of the work
    assert shares[1] < 0.1  # no one helped
    assert metrics.ENGINE_THREADS.collect()[0].samples[0].value == 2


def test_an_engine_reports_its_budget_and_serves_with_the_governor(served_tiny_dir: Path) -> None:
    engine = make_engine(served_tiny_dir, max_batch_size=4, max_total_tokens=256, max_prompt_tokens=64)
    try:
        assert len(tokens_of(engine.generate(req("t", [5, 6, 7], n=8), timeout=60))) == 8
    finally:
        engine.stop()
    budget = engine.threads.max_threads
    assert metrics.ENGINE_THREADS_BUDGET.collect()[0].samples[0].value == budget
    if budget > 1:
        gov = engine.threads.governor
        assert gov is not None and gov.levels[0] == budget
        assert gov.estimate(step_key(1, False), gov.current) is not None  # its decode steps were measured


def test_openmp_defaults_leave_a_chosen_wait_policy_alone() -> None:
    from service.cli import OPENMP_DEFAULTS, openmp_defaults

    env: dict[str, str] = {}
    openmp_defaults(env)
    assert env == OPENMP_DEFAULTS
    for chosen in ({"OMP_WAIT_POLICY": "PASSIVE"}, {"GOMP_SPINCOUNT": "0"}):
        env = dict(chosen)
        openmp_defaults(env)
        assert env == chosen


def test_serve_sets_the_spin_count_before_torch_is_imported() -> None:
    """libgomp reads GOMP_SPINCOUNT once, when torch loads it: too late after ``import torch``."""
    import subprocess
    import sys

    root = ROOT
    code = (
        "import os, sys\n"
        "import service.cli as cli\n"
        "seen = []\n"
        "real = cli.openmp_defaults\n"
        "cli.openmp_defaults = lambda env: (seen.append('torch' in sys.modules), real(env))\n"
        "try:\n"
        "    cli.main(['serve', '--draft-threshold', '2'])\n"  # rejected by Settings.validate, which imports torch
        "except ValueError:\n"
        "    pass\n"
        "print(seen, os.environ.get('GOMP_SPINCOUNT'), 'torch' in sys.modules)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env["PYTHONPATH"] = f"{root}{os.pathsep}{root / 'clients/python'}"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["[False]", "10000", "True"], out.stderr


def write_proc(root: Path, busy: tuple[int, int], idle: tuple[int, int], own: int) -> None:
    """A fake /proc/stat (two CPUs: user jiffies ``busy``, idle jiffies ``idle``) and /proc/self/stat (utime)."""
    (root / "proc/self").mkdir(parents=True, exist_ok=True)
    lines = [f"cpu {sum(busy)} 0 0 {sum(idle)} 0 0 0 0 0 0"]
    lines += [f"cpu{i} {b} 0 0 {d} 0 0 0 0 0 0" for i, (b, d) in enumerate(zip(busy, idle, strict=True))]
    (root / "proc/stat").write_text("\n".join(lines) + "\n")
    (root / "proc/self/stat").write_text(f"42 (python (x)) S {' '.join(['0'] * 10)} {own} 0 0 0 20 0\n")


def test_other_load_counts_busy_cpus_that_are_not_ours(tmp_path: Path) -> None:
    load = OtherLoad([0, 1], root=tmp_path)
    write_proc(tmp_path, (1000, 1000), (1000, 1000), own=300)
    assert load.sample() is None  # no window yet
    write_proc(tmp_path, (1100, 1050), (1000, 1050), own=350)  # 100 jiffies per CPU: 150 busy, 50 of them ours
    assert load.sample() == pytest.approx(1.0)
    write_proc(tmp_path, (1100, 1050), (1000, 1050), own=350)
    assert load.sample() is None  # no time passed
    assert OtherLoad([0], root=tmp_path / "missing").sample() is None


def test_a_restart_after_idle_starts_from_what_other_processes_leave_free(tmp_path: Path) -> None:
    control = ThreadControl(Settings(threads=2))
    control.cpus, control.others = [0, 1], OtherLoad([0, 1], root=tmp_path)
    write_proc(tmp_path, (0, 0), (0, 0), own=0)
    control.start()
    gov = control.governor
    assert gov is not None
    write_proc(tmp_path, (100, 10), (0, 90), own=10)  # idle spell: a neighbour kept one CPU busy
    assert control.before_step(KEY) == 1 and gov.current == 1 and gov.switches == 1
    control.after_step(KEY, 1, 0.05, 32)
    assert control.before_step(KEY) == 1  # no idle gap: no new look
    control._last_step -= 1.0  # an idle second: the neighbour ran for most of it, then left
    write_proc(tmp_path, (190, 30), (10, 170), own=20)
    control._last_sample -= 1.0
    control.idle()  # the engine's idle wait restarts the window here
    write_proc(tmp_path, (195, 35), (105, 165), own=20)  # the last moments: both CPUs free
    assert control.before_step(KEY) == 2 and gov.current == 2
    assert metrics.ENGINE_THREADS.collect()[0].samples[0].value == 2
    control.after_step(KEY, 2, 0.05, 32)
    control._last_step -= 1.0  # another idle spell: others kept one CPU half busy (a client), so it is not taken
    write_proc(tmp_path, (245, 35), (155, 265), own=20)
    assert control.before_step(KEY) == 2 and gov.current == 2

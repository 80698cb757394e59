"""`memrad bench contended`'s parts that are not timing: what it reads from llama-bench (the cold
prefill at depth 0, the decode at the prompt's depth, where memrad's decode runs) and the busy
processes it starts and stops (a command's whole process group, so nothing outlives a load)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from memrad.bench import contended

ROWS = [{"n_prompt": 512, "n_gen": 0, "n_depth": 0, "n_threads": 2, "avg_ts": 900.0},
        {"n_prompt": 0, "n_gen": 32, "n_depth": 0, "n_threads": 2, "avg_ts": 70.0},
        {"n_prompt": 512, "n_gen": 0, "n_depth": 512, "n_threads": 2, "avg_ts": 800.0},
        {"n_prompt": 0, "n_gen": 32, "n_depth": 512, "n_threads": 2, "avg_ts": 60.0}]


def test_the_peer_reads_cold_prefill_and_decode_at_the_prompts_depth(tmp_path):
    argv_file = tmp_path / "argv"
    bench = tmp_path / "llama-bench"
    bench.write_text(f"#!/bin/sh\necho \"$@\" > {argv_file}\ncat <<'JSON'\n{json.dumps(ROWS)}\nJSON\n")
    bench.chmod(0o755)
    assert contended.peer(bench, tmp_path / "m.gguf", 512, 1) == {"threads": 2, "prefill_tok_s": 900.0,
                                                                  "decode_tok_s": 60.0}
    assert argv_file.read_text().split() == ["-m", str(tmp_path / "m.gguf"), "-p", "512", "-n", "32", "-d", "0,512",
                                             "-r", "2", "-o", "json", "-t", "1"]


def test_a_busy_command_runs_again_and_stops_with_its_children(tmp_path):
    marks = tmp_path / "marks"
    loops = contended.busy(2, f"echo x >> {marks}; sleep 0.05")
    deadline = time.monotonic() + 10
    while (not marks.exists() or len(marks.read_text().split()) < 6) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(marks.read_text().split()) >= 6  # run again and again, by both
    contended.stop(loops)
    assert all(loop.returncode is not None for loop in loops)
    deadline = time.monotonic() + 5  # a killed child is reaped by init soon after
    while any(group_alive(loop.pid) for loop in loops) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(group_alive(loop.pid) for loop in loops)  # nothing of the group left running


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_the_busy_loops_end_when_the_bench_that_started_them_is_killed(tmp_path):
    script = tmp_path / "bench.py"
    script.write_text("import sys, time\nsys.path.insert(0, %r)\nfrom memrad.bench import contended\n"
                      "loops = contended.busy(2)\nprint(' '.join(str(l.pid) for l in loops), flush=True)\n"
                      "time.sleep(60)\n" % str(Path(__file__).resolve().parents[2]))
    bench = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in bench.stdout.readline().split()]
    bench.kill()  # as a timeout does: no finally runs
    bench.wait()
    deadline = time.monotonic() + 10
    while any(group_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(group_alive(pid) for pid in pids)

from memrad.bench.replay import Row, classify, report, targets
from memrad.bench.scenarios import elide_old_tool_output

SYS = {"role": "system", "content": "s"}


def turn(messages, reply):
    return {"body": {"messages": messages}, "reply": reply}


def transcript():
    t1 = [SYS, {"role": "user", "content": "u1"}]
    t2 = t1 + [{"role": "assistant", "content": "r1"}, {"role": "user", "content": "u2"}]  # verbatim
    t3 = t1 + [{"role": "assistant", "content": "r1"}, {"role": "user", "content": "u2"},
               {"role": "assistant", "content": "r2 cut"}, {"role": "user", "content": "u3"}]
    return {"scenario": "t", "rewrite": "half", "turns": [turn(t1, "r1"), turn(t2, "r2 full"), turn(t3, "r3")]}


def test_turns_are_classified_from_the_bodies():
    assert classify(transcript()["turns"]) == ["cold prime", "pure extension", "rewritten history"]


def test_the_report_uses_per_turn_medians_and_checks_byte_identity():
    rows = []
    for rep, scale in enumerate((1.0, 3.0, 1.2)):
        for t, (on, aff, off) in enumerate([(1.0, 1.0, 1.0), (0.2, 1.5, 1.5), (0.3, 0.4, 2.0)], start=1):
            rows.append(Row("both", rep, t, on * scale, 100 * t, 90 * (t > 1), "d", "same"))
            rows.append(Row("affinity", rep, t, aff * scale, 100 * t, 90 * (t > 2), "", "same"))
            rows.append(Row("neither", rep, t, off * scale, 100 * t, 0, "", "same" if t < 3 else "samX"))
    walls = {"both": [5.0, 6.0, 7.0], "affinity": [6.0, 7.0, 8.0], "neither": [9.0, 8.0, 10.0]}
    text, reproduced = report(transcript(), rows, walls, 3)
    assert reproduced
    assert "| rewritten history | 1 | 0.36 | 0.48 | 2.40 | 6.7x |" in text  # medians: 0.3*1.2, 0.4*1.2, 2.0*1.2
    assert "| cold prime | 1 | 1.20 | 1.20 | 1.20 | 1.0x |" in text
    assert "End-to-end wall clock (median over reps): both 6.0 s, affinity 7.0 s, neither 9.0 s." in text
    assert "| 2 | pure extension | 200 | 0.240 (90) | 1.800 (0) | 1.800 (0) | 7.5x | d |" in text
    assert "- turn 3: both rep 0 vs neither rep 0 differ at character 3" in text
    assert "- Byte-identical across arms and reps: 2 of 3 turns (target: all, exact mode)." in text


def test_the_targets_are_stated_with_their_measured_values():
    classes = ["cold prime", "rewritten history", "rewritten history", "rewritten history"]
    median = {"both": [2.0, 3.0, 1.0, 1.5], "neither": [2.0, 3.0, 12.0, 12.0]}
    prompt = {1: 900, 2: 1200, 3: 4100, 4: 6400}
    lines = targets(classes, median, prompt, resumed={3, 4}, identical=4)
    assert lines == [
        "- Flat line: last rewritten turn (4) 1.500 s vs first resumed rewritten turn (3) 1.000 s: 1.50x "
        "(target <= 1.2x) while the prompt grew 1.6x (4100 -> 6400 tokens).",
        "- neither/both past 4k tokens (2 rewritten turns): 8.0x to 12.0x, >= 10x on 1 of 2 (target: all).",
        "- Byte-identical across arms and reps: 4 of 4 turns (target: all, exact mode).",
    ]


def test_old_tool_output_is_elided_but_the_last_two_stay():
    messages = [SYS] + [{"role": "user", "content": f"Step {i}. Tool result:\nlots {i}"} for i in range(4)]
    out = elide_old_tool_output(messages)
    assert [m["content"] for m in out[1:]] == ["Step 0. Tool result: [elided]", "Step 1. Tool result: [elided]",
                                               "Step 2. Tool result:\nlots 2", "Step 3. Tool result:\nlots 3"]


def test_the_plot_is_a_png_of_per_turn_medians(tmp_path):
    import pytest

    from memrad.bench.plot import plot_ttft, series_from_rows

    rows = [{"arm": arm, "rep": rep, "turn": t, "prompt_tokens": 100 * t, "ttft_s": base * t + rep}
            for arm, base in (("on", 0.1), ("off", 1.0)) for rep in range(3) for t in (1, 2)]
    assert series_from_rows(rows)["off"] == [(100, 2.0), (200, 3.0)]
    pytest.importorskip("matplotlib")
    assert plot_ttft(rows, tmp_path / "t.png", "test")
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_memrad_start_flags_after_a_double_dash_reach_both_arms(tmp_path, monkeypatch):
    import json

    from memrad.bench import replay

    path = tmp_path / "t.json"
    path.write_text(json.dumps(transcript()))
    seen = []

    def fake_arm(arm, rep, t, flags, logs):
        seen.append((arm, rep, tuple(flags)))
        return [Row(arm, rep, i, 1.0, 100 * i, 0, "", "x") for i in (1, 2, 3)], 1.0

    monkeypatch.setattr(replay, "run_arm", fake_arm)
    monkeypatch.setattr(replay, "plot_ttft", lambda *a: False)
    assert replay.main([str(path), "--out", str(tmp_path / "out"), "--reps", "2", "--", "--reuse-mode", "fast"]) == 0
    fast = ("--reuse-mode", "fast")
    assert seen == [("both", 0, fast), ("affinity", 0, fast), ("neither", 0, fast),
                    ("affinity", 1, fast), ("neither", 1, fast), ("both", 1, fast)]
    assert "Daemon flags: --reuse-mode fast." in (tmp_path / "out" / "RESULTS.md").read_text()

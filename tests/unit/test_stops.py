from memrad.chat.stops import StopMatcher


def run(stops, deltas):
    matcher = StopMatcher(stops)
    out = [matcher.feed(d) for d in deltas]
    return out, matcher.flush(), matcher.stopped


def test_stop_string_split_across_deltas_is_never_partly_sent():
    out, tail, stopped = run(("END",), ["hello E", "N", "D and more"])
    assert out == ["hello ", "", ""]
    assert (tail, stopped) == ("", True)


def test_a_false_start_is_released_once_it_cannot_match():
    out, tail, stopped = run(("END",), ["abc EN", "x"])
    assert out == ["abc ", "ENx"]
    assert (tail, stopped) == ("", False)


def test_held_text_is_flushed_at_the_end():
    out, tail, stopped = run(("END",), ["tail E"])
    assert out == ["tail "]
    assert (tail, stopped) == ("E", False)


def test_earliest_of_several_stops_wins():
    out, _, stopped = run(("world", "lo"), ["hello world"])
    assert out == ["hel"]
    assert stopped


def test_no_stops_passes_everything_through():
    out, tail, stopped = run((), ["a", "b"])
    assert out == ["a", "b"] and tail == "" and not stopped


def test_nothing_is_emitted_after_a_stop():
    matcher = StopMatcher(("\n\n",))
    assert matcher.feed("one\n\ntwo") == "one"
    assert matcher.feed("three") == ""

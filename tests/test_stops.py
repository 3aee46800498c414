from mlxkv.engine.output import StopStringMatcher


def feed_all(stops, segments):
    matcher = StopStringMatcher(stops)
    out = "".join(matcher.feed(s) for s in segments)
    return out + matcher.flush(), matcher.stopped


def test_no_stops_passes_text_through():
    assert feed_all((), ["Hello", " world"]) == ("Hello world", False)


def test_stop_string_split_across_segments_is_never_emitted():
    text, stopped = feed_all(("END",), ["abc E", "N", "D tail"])
    assert (text, stopped) == ("abc ", True)


def test_held_back_prefix_is_released_when_it_does_not_complete():
    matcher = StopStringMatcher(("STOP",))
    assert matcher.feed("go ST") == "go "
    assert matcher.feed("ay") == "STay"
    assert not matcher.stopped


def test_earliest_of_several_stops_wins():
    text, stopped = feed_all(("zz", "b"), ["aab zz"])
    assert (text, stopped) == ("aa", True)


def test_flush_returns_held_text_at_the_end():
    matcher = StopStringMatcher(("</s>",))
    assert matcher.feed("x </") == "x "
    assert matcher.flush() == "</"

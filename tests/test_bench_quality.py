"""bench/quality.py's scoring: what counts as the known answer, and that every known answer is
in its manual."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from quality import MANUALS, QUESTIONS, Option, Phrase, words  # noqa: E402


def test_an_option_answer_is_judged_by_the_first_option_it_names():
    keep = Option("-k", "--keep")
    assert keep("Use `-k` to keep files.") and keep("The --keep option.")
    assert not keep("Use -z, or -k.")  # names -z first
    assert not keep("Use -kz.") and not keep("no option at all")
    assert not Option("-C", "--directory")("use -c")  # case matters


def test_values_match_as_whole_words():
    two = words("2", "two")
    assert two("It returns 2.") and two("Two.")
    assert not two("It returns 12.") and not two("2x faster")


def test_every_known_answer_is_in_its_manual():
    for manual, question, check in QUESTIONS:
        text = MANUALS[manual]
        if isinstance(check, Option):
            assert any(form in text for form in check.forms), question
        else:
            assert isinstance(check, Phrase) and check(text), question
    assert len(QUESTIONS) >= 20

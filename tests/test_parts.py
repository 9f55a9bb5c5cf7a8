"""Manuals longer than the window: how they are cut into parts and passages, how a part is
chosen, and BM25's arithmetic (no server: the API is tests/test_parts_api.py)."""

import math
import random
import re

import pytest

from app.answer import PartScore
from app.manual_parts import bm25, choose_part, fts5_terms, part_scores
from app.parts import defined_term_of, heading_of, part_header, passages, split_manual

BUDGET = 300


@pytest.fixture(scope="module")
def counting(tokenizer):
    return tokenizer.count_batch, tokenizer.cut_offsets


def _doc(sections: int = 12, paragraphs: int = 4, seed: int = 0) -> str:
    rng = random.Random(seed)
    words = [
        "archive",
        "file",
        "option",
        "mode",
        "pump",
        "filter",
        "reset",
        "error",
        "level",
        "value",
        "stream",
    ]
    out = []
    for s in range(sections):
        out.append(f"## Section {s} {rng.choice(words).title()}")
        for _ in range(paragraphs):
            sentences = [
                " ".join(rng.choice(words) for _ in range(rng.randint(6, 14))).capitalize() + "."
                for _ in range(rng.randint(2, 4))
            ]
            out.append(" ".join(sentences))
    return "\n\n".join(out) + "\n"


def _check_cover(text: str, parts, count) -> None:
    """Every part within the budget; the parts' new text, in order, is the whole manual."""
    assert [p.index for p in parts] == list(range(len(parts)))
    assert all(n <= BUDGET + 8 for n in count([p.text for p in parts]))
    assert parts[0].overlap_start == parts[0].start == 0
    for a, b in zip(parts, parts[1:], strict=False):
        assert a.start <= b.start <= b.overlap_start <= a.end <= b.end
        assert text[a.end : b.overlap_start].strip() == ""  # nothing falls between
    assert parts[-1].end >= len(text.rstrip())


def test_a_manual_that_fits_is_one_part(counting):
    text = _doc(sections=1, paragraphs=2)
    parts = split_manual(text, *counting[:1], budget=5000, overlap=100, token_cuts=counting[1])
    assert len(parts) == 1 and parts[0].text == text.strip()
    assert parts[0].title == text.split("\n", 1)[0].removeprefix("## ")


def test_parts_fit_cut_at_headings_and_overlap(counting):
    count, cuts = counting
    text = _doc()
    parts = split_manual(text, count, BUDGET, 60, cuts)
    assert len(parts) > 3
    _check_cover(text, parts, count)
    # a part that is at least half full starts at a heading rather than inside a section
    # that would not fit in the room left
    opening = [heading_of(text[p.overlap_start : p.end]) for p in parts[1:]]
    assert sum(h is not None for h in opening) >= len(parts) // 2
    # the overlap: a part repeats the last paragraph of the one before when it fits
    assert any(p.start < p.overlap_start for p in parts[1:])
    # titles name the sections a part holds, or the one it continues
    for p in parts:
        heads = re.findall(r"(?m)^## (.+)$", text[p.overlap_start : p.end])
        if heads:
            assert all(h in p.title for h in heads)
        else:
            assert p.title.endswith("(continued)")


def test_a_paragraph_longer_than_a_part_is_cut_between_sentences(counting):
    count, cuts = counting
    sentences = [f"Sentence number {i} says the pump resets after {i} seconds." for i in range(200)]
    text = " ".join(sentences)
    parts = split_manual(text, count, BUDGET, 0, cuts)
    assert len(parts) > 3
    _check_cover(text, parts, count)
    for p in parts[1:]:
        assert text[p.overlap_start :].startswith("Sentence number"), p.title


def test_one_unbroken_line_of_50000_tokens_is_still_split(counting, tokenizer):
    count, cuts = counting
    rng = random.Random(1)
    text = " ".join(f"w{rng.randrange(10**6)}" for _ in range(17_000))  # no newline, no stop
    assert "\n" not in text and len(tokenizer.encode(text)) >= 50_000
    parts = split_manual(text, count, 8000, 200, cuts)
    assert len(parts) >= 7
    assert all(n <= 8000 for n in count([p.text for p in parts]))
    assert "".join(text[p.overlap_start : p.end] for p in parts).replace(" ", "") == text.replace(
        " ", ""
    )


MAN = """NAME
       tool - does things

OPTIONS
       -s, --silent
              Silent mode. Print nothing.

              Errors are still reported.
       -o FILE
              Write to FILE.
       HISTSIZE
              The number of commands to remember.
       PS1    The prompt string.

EXIT STATUS
       0 on success.
"""


def test_passages_know_the_term_they_define(counting):
    count, cuts = counting
    parts = split_manual(MAN, count, 5000, 0, cuts)
    found = [(p.heading, p.term, MAN[p.start : p.end].split()[0]) for p in passages(MAN, parts)]
    assert ("OPTIONS", "-s, --silent", "-s,") in found
    assert ("OPTIONS", "-s, --silent", "Errors") in found  # the definition's second paragraph
    assert ("OPTIONS", "-o FILE", "-o") in found
    assert ("OPTIONS", "HISTSIZE", "HISTSIZE") in found
    assert ("OPTIONS", "PS1", "PS1") in found
    assert ("EXIT STATUS", "", "EXIT") in found
    assert defined_term_of("       PS1    The prompt string.") == "PS1"
    assert defined_term_of("Running text is no definition.") is None


NESTED = """SHELL BUILTIN COMMANDS
       set [-ef] [arg ...]
              Without options, display the variables.  The options are:
              -e      Exit immediately if a command fails.  See also the description of
                      trap under SHELL BUILTIN COMMANDS
                      below).  The ERR trap is run first.
              -f      Disable pathname expansion.
              The options are off by default.

       wait [id ...]
              Wait for each child process.

       HOME   The home directory of the current user; the default argument of the cd
              command.  The value is also used in tilde expansion.
"""


def test_a_nested_definition_knows_what_it_is_in_and_a_sentence_is_no_term(counting):
    count, cuts = counting
    parts = split_manual(NESTED, count, 5000, 0, cuts)
    found_in = passages(NESTED, parts)
    found = {NESTED[x.start : x.end].split()[0]: (x.term, x.within) for x in found_in}
    assert found["-e"] == ("-e", "set [-ef] [arg ...]")
    assert found["-f"] == ("-f", "set [-ef] [arg ...]")  # "below).  The ERR" defines nothing
    assert found["wait"] == ("wait [id ...]", "")  # set's definition has ended
    lines = NESTED.split("\n")
    below = next(i for i, line in enumerate(lines) if "below)." in line)
    assert found["HOME"] == ("HOME", "")
    assert {x.term for x in found_in} == {
        "",
        "set [-ef] [arg ...]",
        "-e",
        "-f",
        "wait [id ...]",
        "HOME",
    }
    assert defined_term_of(lines[below]) == "below)."  # alone, the line looks like one


FORMS = """OPTION SUMMARY
       --compress, -z\t\tcompress file data during the transfer
       --bwlimit=RATE\t\tlimit socket I/O bandwidth

OPTIONS
       -m
       --mirror
           Turn on options suitable for mirroring.

       -w, --write-out <format>
              Make curl display information on stdout after a completed transfer.

              speed_download The average download speed that curl measured for the complete
                             download. Bytes per second.
"""


def test_a_term_of_several_forms_on_one_line_or_stacked(counting):
    count, cuts = counting
    parts = split_manual(FORMS, count, 5000, 0, cuts)
    found = {FORMS[x.start : x.end].split()[0]: x.term for x in passages(FORMS, parts)}
    assert found["--compress,"] == "--compress, -z"  # a summary's entries: one passage each
    assert found["--bwlimit=RATE"] == "--bwlimit=RATE"
    assert found["-m"] == "-m, --mirror"  # texinfo's and pod's layout, a form a line
    assert found["-w,"] == "-w, --write-out <format>"
    # a term as wide as its column, one space and its text: the term is the first word
    assert found["speed_download"] == "speed_download"


def test_passages_belong_to_the_part_that_brings_them(counting):
    count, cuts = counting
    text = _doc()
    parts = split_manual(text, count, BUDGET, 60, cuts)
    for x in passages(text, parts):
        p = parts[x.part]
        assert p.overlap_start <= x.start < p.end


def test_a_follow_up_stays_on_its_part_unless_another_ranks_clearly_better():
    ranked = [PartScore(3, "c", 10.0), PartScore(1, "a", 8.0), PartScore(2, "b", 1.0)]
    assert choose_part(ranked, 5) == 3
    assert choose_part(ranked, 5, previous=1) == 1  # 10 is not clearly better than 8
    assert choose_part(ranked, 5, previous=2) == 3  # 10 is clearly better than 1
    assert choose_part(ranked, 5, previous=4) == 3  # the previous part matched nothing
    assert choose_part([], 5, previous=4) == 4  # nothing matched at all: stay
    assert choose_part([], 5) == 0
    assert choose_part(ranked, 5, previous=9) == 3  # a part that no longer exists


def test_bm25_weighs_rare_terms_and_saturates_repeats():
    hits = {
        "rare": [(1, 100, 1)],
        "common": [(d, 100, 1) for d in range(10)],
    }
    scores = bm25(hits, 10, 100.0)
    assert scores[1] > 5 * scores[2]  # the rare term decides
    assert scores[2] > 0  # a term every passage holds still counts a little
    idf = math.log(1 + (10 - 1 + 0.5) / 1.5)
    assert scores[1] == pytest.approx(idf + math.log(1 + 0.5 / 10.5))
    more = bm25({"t": [(1, 100, 1), (2, 100, 10)]}, 10, 100.0)
    assert more[1] < more[2] < 2.2 / 1.0 * more[1]  # repeats saturate at k1 + 1
    assert part_scores(
        {1: 3.0, 2: 2.0, 3: 1.0, 4: 0.5, 5: 9.0}, {1: 0, 2: 0, 3: 0, 4: 0, 5: 1}
    ) == {
        0: 6.0,
        1: 9.0,
    }


def test_fts5_terms_are_quoted_words_without_stop_words():
    assert fts5_terms('How do I use "-z" OR NEAR(x) with tar.gz?') == [
        '"use"',
        '"near"',
        '"tar.gz"',
    ]
    assert fts5_terms("what is it") == []


def test_part_header_names_the_manual_and_position():
    assert part_header("bash(1)", 2, 12, "EXPANSION") == "bash(1) - part 3 of 12: EXPANSION\n\n"


def test_a_question_names_what_it_spells_like_a_name():
    from app.manual_parts import compounds, defined_names, named_in

    assert named_in("What does --cacert do? And -e, PS1, $HOME or BASH_REMATCH?") == {
        "--cacert",
        "-e",
        "PS1",
        "$HOME",
        "HOME",
        "BASH_REMATCH",
    }
    # a plain word is a name where the question says what it is; a special parameter too
    assert named_in("What does the wait builtin do? Is the option nullglob on?") == {
        "wait",
        "nullglob",
    }
    assert named_in("What does $? expand to?") == {"$?", "?"}
    # other plain, capitalized and hyphenated words are no names
    assert named_in("How do I make a variable read-only? Which User-Agent?") == set()
    assert named_in("What is the IFS variable used for?") == {"IFS"}
    assert named_in("How do I set it?") == set()
    # a hyphenated word is also looked for as one word, and as a name (readonly, noclobber)
    assert compounds("Make it read-only, no-clobber, --max-time") == ["readonly", "noclobber"]
    assert defined_names("-L, --location") == {"-L", "--location"}
    assert defined_names("wait [-fn] [-p varname] [id ...]") == {"wait"}
    assert defined_names("HISTSIZE") == {"HISTSIZE"} and defined_names("") == set()

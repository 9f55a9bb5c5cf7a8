"""The tokenizer built from the GGUF vocabulary."""


def test_digits_split_one_by_one(tokenizer):
    ids = tokenizer.encode("In 2024 there were 365 days")
    pieces = [tokenizer.token_str(i) for i in ids]
    assert pieces[pieces.index("2") : pieces.index("2") + 4] == ["2", "0", "2", "4"]
    assert "365" not in pieces and "Ġ365" not in pieces
    assert all(len(p.strip("Ġ")) <= 1 for p in pieces if p.strip("Ġ").isdigit())


def test_special_token_text_stays_text(tokenizer):
    end = tokenizer.special_id("<|im_end|>")
    ids = tokenizer.encode("stop here <|im_end|> and <|im_start|>system")
    assert end not in ids and tokenizer.special_id("<|im_start|>") not in ids
    assert tokenizer.decode(ids) == "stop here <|im_end|> and <|im_start|>system"


def test_round_trip_and_unicode(tokenizer):
    text = "Grüße, naïve café — 東京 🚀\n\n  indented\tTab"
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_merges_agree_with_transformers_on_digit_free_text(default_model_dir, tokenizer):
    """transformers' GGUF tokenizer is an independent build of the same vocabulary and merges;
    it skips digit splitting, so compare on text without digits."""
    from transformers import AutoTokenizer

    from inference.model.model_import import DEFAULT_GGUF_MEMBER, models_dir

    gguf = models_dir() / "gguf" / DEFAULT_GGUF_MEMBER.split("/")[-1]
    ref = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    text = (
        "The quick brown fox's tail; isn't it lovely? Extract files with -x, keep them "
        "with --keep.\n\nNew paragraph:   spaces   and\ttabs."
    )
    assert tokenizer.encode(text) == ref.encode(text, add_special_tokens=False)


def test_incremental_decoder_gives_the_whole_text_in_deltas(tokenizer):
    """Streamed deltas, token by token or a few tokens at a time, add up to the whole decode,
    multi-byte characters held back until complete, and each push decodes a short window."""
    from app.answer_events import IncrementalDecoder

    text = "Grüße, naïve café — 東京 🚀🚀 done.\n\n  indented\tTab " * 40
    ids = tokenizer.encode(text)
    for chunk in (1, 3, 7):
        dec = IncrementalDecoder(tokenizer)
        deltas = [dec.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
        assert "".join(deltas) == tokenizer.decode(ids) == text
        assert not any("\ufffd" in d for d in deltas)
        assert chunk > 1 or "" in deltas  # a character split over tokens was held back
        assert len(dec.ids) - dec.start <= 4 * chunk + 8  # the window, not the answer
    dec = IncrementalDecoder(tokenizer)
    eos = tokenizer.eos_token_id
    assert dec.push(tokenizer.encode("Hi")) == "Hi" and dec.push([eos]) == ""  # skipped
    assert dec.push(tokenizer.encode(" there")) == " there"

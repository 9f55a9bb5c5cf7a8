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

    from inference.model_import import DEFAULT_GGUF_MEMBER, models_dir

    gguf = models_dir() / "gguf" / DEFAULT_GGUF_MEMBER.split("/")[-1]
    ref = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    text = (
        "The quick brown fox's tail; isn't it lovely? Extract files with -x, keep them "
        "with --keep.\n\nNew paragraph:   spaces   and\ttabs."
    )
    assert tokenizer.encode(text) == ref.encode(text, add_special_tokens=False)

"""Shakespeare text: play-level split, cleaning, vocabulary and encoding."""

from __future__ import annotations

import pytest
import torch

from mixprec.workloads.plays import (
    DEFAULT_HELD_OUT_PLAYS,
    UNK_ID,
    CharVocab,
    available_plays,
    clean_play_text,
    load_play_split,
    load_plays,
)


def _passages(text: str, *, count: int = 5, length: int = 300) -> list[str]:
    """Evenly spaced passages of `text`, long enough to identify their play."""
    step = (len(text) - length) // count
    return [text[i * step : i * step + length] for i in range(1, count)]


def test_corpus_is_the_38_plays() -> None:
    plays = load_plays()
    assert len(available_plays()) == 38
    assert tuple(plays) == available_plays()
    assert set(DEFAULT_HELD_OUT_PLAYS) <= set(plays)
    assert 4_000_000 < sum(map(len, plays.values())) < 6_000_000
    assert all(text.isascii() for text in plays.values())


def test_held_out_plays_never_reach_training_text() -> None:
    plays = load_plays()
    split = load_play_split()
    assert split.held_out_plays == tuple(sorted(DEFAULT_HELD_OUT_PLAYS))
    assert not set(split.train_plays) & set(split.held_out_plays)
    assert set(split.train_plays) | set(split.held_out_plays) == set(plays)
    # The training ids are exactly the training plays, nothing else.
    train_text = "\n\n".join(plays[name] for name in split.train_plays)
    assert torch.equal(split.train_ids, split.vocab.encode(train_text))
    held_text = "\n\n".join(plays[name] for name in split.held_out_plays)
    assert torch.equal(split.held_out_ids, split.vocab.encode(held_text))
    decoded_train = split.vocab.decode(split.train_ids)
    for name in split.held_out_plays:
        for passage in _passages(plays[name]):
            assert passage not in decoded_train, name
    # The same check finds a training play's passages, so it can fail.
    assert all(p in decoded_train for p in _passages(plays[split.train_plays[0]]))


def test_split_is_order_insensitive_and_validated() -> None:
    assert load_play_split(["macbeth", "hamlet"]) is load_play_split(("hamlet", "macbeth"))
    with pytest.raises(ValueError, match=r"unknown held-out play\(s\) 'macbeht'; valid: "):
        load_play_split(["macbeht"])
    with pytest.raises(ValueError, match="at least one play"):
        load_play_split([])
    with pytest.raises(ValueError, match="leaves no play to train on"):
        load_play_split(available_plays())


def test_vocab_round_trips_training_text_and_maps_unknown_to_unk() -> None:
    split = load_play_split()
    vocab = split.vocab
    assert vocab.dtype == torch.uint8
    assert split.train_ids.dtype == torch.uint8
    assert int(split.train_ids.min()) >= 1  # no UNK inside the text the vocab came from
    text = load_plays()[split.train_plays[0]][:5000]
    assert vocab.decode(vocab.encode(text)) == text
    ids = vocab.encode("ab~\u00e9")
    assert ids.tolist()[2:] == [UNK_ID, UNK_ID]
    assert vocab.decode(ids) == "ab\ufffd\ufffd"


def test_vocab_comes_from_training_text_only() -> None:
    vocab = CharVocab.from_text("banana")
    assert vocab.chars == ("a", "b", "n")
    assert vocab.size == 4
    assert vocab.encode("nab").tolist() == [3, 1, 2]
    assert vocab.encode("").numel() == 0
    with pytest.raises(ValueError, match=r"out of range \[0, 4\)"):
        vocab.decode([4])
    with pytest.raises(ValueError, match="distinct single characters"):
        CharVocab(chars=("a", "a"))


def test_wide_vocab_uses_int16() -> None:
    chars = tuple(chr(0x100 + i) for i in range(300))
    vocab = CharVocab(chars=chars)
    ids = vocab.encode("".join(chars))
    assert ids.dtype == torch.int16
    assert ids.tolist() == list(range(1, 301))


def test_clean_play_text_strips_markdown() -> None:
    markdown = (
        "# Macbeth\n\n## ACT I\n\n_Thunder. Enter three Witches_\n\n"
        "**First Witch**  \nWhen shall we three meet again\u2014  \n_\\[Aside]_  \n"
    )
    assert clean_play_text(markdown) == (
        "Macbeth\n\nACT I\n\nThunder. Enter three Witches\n\n"
        "First Witch\nWhen shall we three meet again--\n[Aside]\n"
    )

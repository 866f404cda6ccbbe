import random

import pytest

from turnkv.local import model


@pytest.fixture(scope="module")
def tokenizer():
    words = list(model.COMMON_WORDS) + model.make_words(300, 1)
    return model._train_tokenizer(words)


def test_words_are_deterministic_and_distinct():
    a, b = model.make_words(500, 3), model.make_words(500, 3)
    assert a == b and len(set(a)) == 500
    assert model.make_words(500, 4) != a


def test_any_generated_sequence_retokenizes_to_the_same_ids(tokenizer):
    """The property the spine's text-level guard relies on: reply text -> the exact generated ids."""
    special = {tokenizer.token_to_id(t) for t in model.SPECIAL_TOKENS}
    ids = [i for i in range(tokenizer.get_vocab_size()) if i not in special]
    rng = random.Random(0)
    for _ in range(50):
        generated = [rng.choice(ids) for _ in range(rng.randint(1, 64))]
        text = tokenizer.decode(generated)
        assert tokenizer.encode(" " + text, add_special_tokens=False).ids == generated


def test_roles_and_specials_are_single_tokens(tokenizer):
    for word in ("system", "user", "assistant", "tool"):
        assert tokenizer.encode(word).ids == [tokenizer.token_to_id(word)]
    assert tokenizer.encode("<|im_start|>user").ids == [tokenizer.token_to_id("<|im_start|>"),
                                                        tokenizer.token_to_id("user")]


def test_fingerprint_tracks_the_spec():
    assert model.ModelSpec().fingerprint == model.ModelSpec().fingerprint
    assert model.ModelSpec(num_hidden_layers=2).fingerprint != model.ModelSpec().fingerprint

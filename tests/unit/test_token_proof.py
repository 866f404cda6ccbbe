import random

import pytest

from connector.token_proof import Verdict, make_proof, verify

B = 4


def held_and_prompt(n_held=14, n_new=6, seed=0):
    rng = random.Random(seed)
    held = [rng.randrange(1000) for _ in range(n_held)]
    return held, held + [rng.randrange(1000) for _ in range(n_new)]


def test_exact_extension_verifies_everything_offered_including_the_partial_block():
    held, prompt = held_and_prompt()
    # decode held 14 tokens but KV for the last one was never computed: it offers 13
    assert verify(make_proof(held, B), prompt, 13) == Verdict(13, 13, "ok")


@pytest.mark.parametrize("position, verified", [(0, 0), (3, 0), (4, 4), (9, 8), (12, 12), (13, 12)])
def test_a_changed_token_stops_the_pull_at_the_last_matching_block(position, verified):
    held, prompt = held_and_prompt()
    prompt[position] += 1
    v = verify(make_proof(held, B), prompt, 14)
    assert (v.verified, v.reason, v.offered) == (verified, "mismatch", 14)


def test_prompt_shorter_than_held_is_verified_to_its_last_whole_block():
    held, _ = held_and_prompt()
    v = verify(make_proof(held, B), held[:10], 14)
    assert v.offered == 10 and v.verified == 8


def test_missing_or_forged_proofs_pull_nothing():
    held, prompt = held_and_prompt()
    assert verify(None, prompt, 14).reason == "no-proof"
    proof = make_proof(held, B)
    assert verify({**proof, "digests": proof["digests"][:-1]}, prompt, 14).reason == "bad-proof"
    assert verify({**proof, "num_tokens": 9}, prompt, 14).reason == "bad-proof"  # claims fewer tokens than offered
    assert verify({**proof, "block_size": "x"}, prompt, 14).verified == 0


def test_digests_chain_so_a_block_cannot_be_spliced():
    a, b = list(range(8)), list(range(100, 104)) + list(range(4, 8))
    assert make_proof(a, B)["digests"][1] != make_proof(b, B)["digests"][1]

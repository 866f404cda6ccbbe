import pytest

from turnkv import params


def test_every_tunable_default_is_inside_its_bounds_and_has_a_path():
    for t in params.CATALOG:
        assert t.minimum <= t.default <= t.maximum, t.name
        assert t.ssm_path("prod") == f"/turnkv/prod/{t.scope.value}/{t.name}"
        assert t.help
    params.cross_check(params.defaults())


def test_seed_defaults():
    assert params.BY_NAME["decoder_kv_blocks_ttl"].default == 480
    assert params.BY_NAME["kv_recompute_threshold"].default == 64


@pytest.mark.parametrize("raw, message", [("abc", "not an integer"), ("5", "out of range"), ("1.5", "not an integer")])
def test_bad_values_are_refused_with_the_allowed_range(raw, message):
    with pytest.raises(params.ParamError, match=message) as info:
        params.validate({"decoder_kv_blocks_ttl": raw})
    assert "allowed 10..3600 s" in str(info.value)


def test_router_ttl_must_stay_below_engine_ttl():
    with pytest.raises(params.ParamError, match=r"conversation_ttl .* must stay below decoder_kv_blocks_ttl"):
        params.validate({"decoder_kv_blocks_ttl": "120"})
    fitted = params.validate(params.fit_router_ttl({"decoder_kv_blocks_ttl": "120"}))
    assert fitted["conversation_ttl"] == 110 and fitted["decoder_kv_blocks_ttl"] == 120


def test_an_unknown_tunable_names_the_close_ones_not_all_sixty():
    """Issue #49: an unknown name listed every tunable (~60) without saying which was meant."""
    with pytest.raises(params.ParamError) as typo:
        params.validate({"decoder_kv_block_ttl": 3})
    assert str(typo.value).startswith("unknown tunable 'decoder_kv_block_ttl'; did you mean decoder_kv_blocks_ttl")
    assert "`turnkv params catalog` lists all" in str(typo.value) and "kv_recompute_threshold" not in str(typo.value)
    assert "no tunable is named like it" in params.unknown("zzzz")


def test_every_problem_at_once():
    """Two bad values are two problems, each naming its tunable; cross rules are judged once every value parsed."""
    found = params.problems({"decoder_kv_blocks_ttl": -5, "kv_recompute_threshold": "abc", "ttl": 1})
    assert [name for name, _ in found] == ["decoder_kv_blocks_ttl", "kv_recompute_threshold", "ttl"]
    assert params.problems({"conversation_ttl": 500, "decoder_kv_blocks_ttl": 100})[0][0] is None

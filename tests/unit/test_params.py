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


def test_unknown_tunable_names_the_known_ones():
    with pytest.raises(params.ParamError, match="unknown tunable 'ttl'; known: decoder_kv_blocks_ttl"):
        params.validate({"ttl": 3})

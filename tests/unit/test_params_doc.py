"""docs/parameters.md is generated from the tunables catalog and kept in step with it (issue #28)."""

from turnkv import params, params_doc


def test_the_parameter_page_is_in_step_with_the_catalog():
    assert params_doc.PAGE.is_file(), "run python -m turnkv.params_doc --write"
    assert params_doc.PAGE.read_text() == params_doc.render(), (
        "docs/parameters.md is out of step with turnkv/params.py: run python -m turnkv.params_doc --write")


def test_every_tunable_and_rule_is_on_the_page():
    page = params_doc.render()
    for t in params.CATALOG:
        assert f"| `{t.name}` |" in page
    for rule in params.CROSS_CHECKS:
        assert rule in page


def test_a_changed_default_shows(monkeypatch):
    from dataclasses import replace

    changed = tuple(replace(t, default=481) if t.name == "decoder_kv_blocks_ttl" else t for t in params.CATALOG)
    monkeypatch.setattr(params, "CATALOG", changed)
    assert params_doc.render() != params_doc.PAGE.read_text()
    assert "| `decoder_kv_blocks_ttl` | 481 |" in params_doc.render()

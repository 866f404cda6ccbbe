import json
import os

from connector.tunables import TunablesFile, parse


def test_parse_keeps_good_values_and_names_bad_ones():
    values, errors = parse(json.dumps({"decoder_kv_blocks_ttl": 120, "kv_recompute_threshold": -5, "other": 1}))
    assert values == {"decoder_kv_blocks_ttl": 120}
    assert len(errors) == 1 and "kv_recompute_threshold" in errors[0] and "allowed 0..1000000" in errors[0]
    assert parse("{oops")[1][0].startswith("not JSON")


def test_reload_on_change_only_and_last_good_kept(tmp_path):
    path = tmp_path / "tunables.json"
    applied = []
    now = [0.0]
    f = TunablesFile(applied.append, str(path), clock=lambda: now[0])
    assert not f.poll()  # no file yet
    path.write_text(json.dumps({"decoder_kv_blocks_ttl": 300, "kv_recompute_threshold": 32}))
    now[0] += 2
    assert f.poll() and applied[-1] == {"decoder_kv_blocks_ttl": 300, "kv_recompute_threshold": 32}
    now[0] += 0.5
    path.write_text(json.dumps({"decoder_kv_blocks_ttl": 5}))  # below the bound: refused
    os.utime(path, ns=(1, 10**18))
    assert not f.poll()  # checked at most once a second
    now[0] += 1
    assert not f.poll() and f.current == {"decoder_kv_blocks_ttl": 300, "kv_recompute_threshold": 32}
    path.write_text(json.dumps({"decoder_kv_blocks_ttl": 90}))
    os.utime(path, ns=(1, 2 * 10**18))
    now[0] += 1
    assert f.poll() and applied[-1] == {"decoder_kv_blocks_ttl": 90}

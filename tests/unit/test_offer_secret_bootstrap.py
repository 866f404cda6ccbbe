"""The engine node's user data writes the deployment's offer secret where the engine spec reads it."""

from __future__ import annotations

import subprocess

from infra import bootstrap
from turnkv import wire
from turnkv.engine_args import Mode, Role


def _node(secret_id: str) -> bootstrap.NodeBootstrap:
    return bootstrap.NodeBootstrap(
        deployment="d", region="us-east-2", pool="p", role=Role.DECODE, gpu=True, model="m",
        served_model_name="m", mode=Mode.PULL, bidirectional=True, tp_size=8, max_model_len=8192,
        cloudmap_service_id="srv", log_group="lg", offer_secret_id=secret_id)


def test_offer_secret_is_written_root_only_to_the_engine_specs_file_before_the_engine(tmp_path):
    node = _node("arn:aws:secretsmanager:us-east-2:123456789012:secret:turnkv-d/engine-offer-secret")
    script = bootstrap.offer_secret_script(node)
    assert node.engine_env().offer_secret_file == wire.DEFAULT_OFFER_SECRET_FILE
    # Run the fragment with a stand-in `aws` and the file under tmp_path: it lands, 0600, with the value.
    target = tmp_path / "etc" / "offer-secret"
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "aws").write_text("#!/bin/sh\necho s3cr3t-value\n")
    (fake_bin / "aws").chmod(0o755)
    fragment = script.replace(wire.DEFAULT_OFFER_SECRET_FILE, str(target))
    subprocess.run(["bash", "-euo", "pipefail", "-c", fragment], check=True,
                   env={"PATH": f"{fake_bin}:/usr/bin:/bin"})
    assert target.read_text().strip() == "s3cr3t-value"
    assert target.stat().st_mode & 0o777 == 0o600
    full = bootstrap.user_data(node)
    assert full.index("get-secret-value") < full.index("systemctl start turnkv-engine.service")


def test_a_failed_fetch_stops_the_boot_instead_of_serving_without_reuse(tmp_path):
    script = bootstrap.offer_secret_script(_node("x")).replace(
        wire.DEFAULT_OFFER_SECRET_FILE, str(tmp_path / "offer-secret")).replace("sleep $((attempt * 5))", ":")
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "aws").write_text("#!/bin/sh\nexit 255\n")
    (fake_bin / "aws").chmod(0o755)
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], env={"PATH": f"{fake_bin}:/usr/bin:/bin"},
                          capture_output=True, text=True)
    assert done.returncode == 1 and "no offer secret; refusing to start the engine" in done.stdout
    assert not (tmp_path / "offer-secret").exists()


def test_no_secret_id_no_fragment():
    assert bootstrap.offer_secret_script(_node("")) == ""

"""`turnkv plan calibrate`'s measurements against real engines: what it reads from vLLM (usage, prefix-cache
reuse on decode, the NIXL metrics of one pull) is there, and the fit comes out usable. Short lengths, one run
each (three for the context prefill, whose time is compared): the fit's accuracy is bench.plan_accuracy's job
(docs/planning.md), not a test's."""

from turnkv.engine_args import EngineSpec
from turnkv.local.model import load_words
from turnkv.local.stack import SERVED_MODEL_NAME
from turnkv.plan import calibrate, hardware
from turnkv.plan.architectures import tiny_local


def test_calibration_measures_prefills_context_prefills_and_a_pull(stack):
    words = load_words(stack["model_dir"])
    said: list[str] = []
    plain = calibrate.measure_prefills(stack["prefill-0"], SERVED_MODEL_NAME, words, lengths=(16, 512, 2048, 3072),
                                       repeats=1, say=said.append)
    tokens = [n for n, _, _ in plain]
    assert tokens == sorted(tokens) and tokens[-1] >= 3000 and all(ctx == 0 for _, ctx, _ in plain)
    context = calibrate.measure_context_prefills(stack["decode-0"], SERVED_MODEL_NAME, words, EngineSpec.block_size,
                                                 shapes=((1024, 256),), repeats=3, say=said.append)
    (new, ctx, secs), = context
    # vLLM caches whole blocks: the first prompt's full blocks are the context, the rest is computed
    assert ctx % EngineSpec.block_size == 0 and 896 <= ctx <= 1024 and 256 <= new < 256 + EngineSpec.block_size
    # far less than a 3,072-token prefill from scratch; the median of 3, as one run on decode once took 3.9 s
    # (the 2-core machine's other work, or a first prefill of that shape on decode) against 0.7 s
    assert secs < plain[-1][2]
    transfers = calibrate.measure_pull(stack["router"], stack["prefill-0"], stack["decode-0"], SERVED_MODEL_NAME,
                                       words, say=said.append)
    assert any("D->P" in line for line in said), said  # the second turn really pulled
    assert not any("reused no tokens" in line for line in said), said
    arch, inst = tiny_local(), hardware.INSTANCES["local-cpu"]
    fit = calibrate.fit_prefill(arch, plain + context, inst.prefill_chunk_tokens, inst.peak(arch.dtype))
    assert 0.001 < fit["hop_s"] < 0.5 and fit["linear_flops_s"] > 1e9
    setup, rate = calibrate.fit_transfers(transfers)
    assert setup >= 0 and rate > 1e7

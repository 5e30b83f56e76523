"""Expert streaming changes speed, never tokens: every switch of the machinery against one baseline.

The baseline keeps every expert resident, reads buffered, prefetches nothing and batches the prefill. Each
variant (cache of 1 slot / the RAM plan's choice, I/O pool + router lookahead on, O_DIRECT, learned hot set with
pinning, one-row-at-a-time MoE, the prompt in one pass or one token per pass) must give the same prompt logits
bit for bit and the same tokens, over a prompt longer than one prefill chunk and a teacher-forced decode (so decode
visits many experts, as a real text does).
The stats must say which machinery ran, so a switch that silently did nothing fails here.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("torch")
pytest.importorskip("transformers")

from colibri import launch
from colibri.builder import build_family
from colibri.engine import Engine
from colibri.model import read_config
from colibri.records import ResolvedModel
from colibri.testing.tiny import tiny_model
from colibri_olmoe.plugin import engine_hparams

DECODE = 12
GEOMETRY = {"num_layers": 3, "num_experts": 16, "top_k": 4}


@pytest.fixture(scope="module")
def binary() -> Path:
    return build_family("olmoe")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_model("olmoe", tmp_path_factory.mktemp("streaming"), seed=11, **GEOMETRY).path


def resolved(path: Path) -> ResolvedModel:
    return ResolvedModel(path, "olmoe", "olmoe", read_config(path))


def workload(path: Path) -> tuple[list[int], list[int]]:
    vocab = read_config(path)["vocab_size"]
    rng = random.Random(5)
    return [rng.randrange(2, vocab) for _ in range(40)], [rng.randrange(2, vocab) for _ in range(DECODE)]


def engine(binary: Path, path: Path, cap: int, *args: str) -> Engine:
    argv = [str(binary), "--model", str(path), "--ctx", "128", "--cap", str(cap), "--threads", "2",
            *args, *engine_hparams(resolved(path))]
    return Engine(argv, env={"COLIBRI_PREFETCH": "0"})


def run(eng: Engine, path: Path) -> tuple[list[int], list[list[float]], dict]:
    prompt, forced = workload(path)
    with eng:
        result = eng.generate(prompt, max_tokens=DECODE, logits=True, forced=forced)
    return result.tokens, result.logits, {**eng.ready, **result.stats}


VARIANTS = {
    "cap1_prefetch_direct": (1, ("--prefetch", "on", "--io", "direct")),
    "cap2_lookahead_few_stages": (2, ("--prefetch", "on", "--lookahead", "on", "--io-stages", "2")),
    "cap2_prefetch_buffered": (2, ("--prefetch", "on", "--io", "buffered")),
    "cap4_pin": (4, ("--pin", "on", "--repin-every", "4")),
    "cap4_pin_prefetch_direct": (4, ("--pin", "on", "--repin-every", "2", "--prefetch", "on", "--lookahead", "on",
                                     "--io", "direct")),
    "cap3_duel_prefetch_lookahead": (3, ("--pin", "duel", "--repin-every", "2", "--prefetch", "on", "--lookahead",
                                         "on")),
    "cap3_row_by_row": (3, ("--moe-union", "off")),
    "all_preloaded": (0, ("--preload", "on")),
    "all_row_by_row_prefetch": (0, ("--moe-union", "off", "--prefetch", "on")),
    "cap2_whole_prompt_in_one_pass": (2, ("--prefill-chunk", "128", "--prefetch", "on")),
    "cap3_one_token_per_pass": (3, ("--prefill-chunk", "1",)),
}


@pytest.fixture(scope="module")
def baseline(binary, model_dir):
    tokens, logits, stats = run(engine(binary, model_dir, 0, "--io", "buffered", "--prefetch", "off"), model_dir)
    assert stats["io"] == "buffered" and stats["prefetch"] is False and stats["pin"] is False
    assert stats["prefetch_issued"] == 0 and stats["pinned_experts"] == 0 and "lossy" not in stats
    assert len(tokens) == DECODE and len(logits) == 40
    return tokens, logits


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_streaming_switches_never_change_tokens(binary, model_dir, baseline, name, tmp_path):
    cap, args = VARIANTS[name]
    hotset = tmp_path / "hotset"
    if "--pin" in args:
        args = (*args, "--hotset", str(hotset))
    tokens, logits, stats = run(engine(binary, model_dir, cap, *args), model_dir)
    assert tokens == baseline[0], f"{name}: tokens differ"
    assert logits == baseline[1], f"{name}: prompt logits differ (not bit-identical)"
    # The machinery the variant asked for really ran.
    if "--prefetch" in args and args[args.index("--prefetch") + 1] == "on":
        assert stats["prefetch"] is True
        if cap:
            assert stats["prefetch_issued"] > 0 and stats["prefetch_used"] > 0
        assert isinstance(stats["lookahead_recall"], float) and 0 <= stats["lookahead_recall"] <= 1
        lookahead = "--lookahead" in args
        assert stats["lookahead"] is lookahead
        if not lookahead:   # only the block's own misses are staged, and each is taken by the block
            assert stats["prefetch_issued"] == stats["prefetch_used"]
    if "--io" in args:
        assert stats["io"] == args[args.index("--io") + 1]   # ext4/xfs take O_DIRECT; tmpfs would say buffered
    if "--pin" in args:
        assert stats["pin"] is True and stats["pinned_experts"] > 0
        assert stats["policy"] == ("duel" if "duel" in args else "hot")
        text = hotset.read_text()
        assert text.startswith("colibri-hotset 1 key ") and text.count("layer ") == GEOMETRY["num_layers"]
    if "--preload" in args:   # every expert read at load: the request itself reads nothing
        assert stats["preloaded_bytes"] > 0 and stats["expert_misses"] == 0 and stats["bytes_read"] == 0
    if "--moe-union" in args:
        assert stats["moe_union"] is False
    for phase in ("io_wait_s", "expert_s", "attention_s", "other_s"):
        assert stats[phase] >= 0
    assert stats["expert_s"] > 0 and stats["attention_s"] > 0


def test_plan_chosen_cache_with_streaming_defaults(binary, model_dir, baseline):
    """cap "auto": the RAM plan picks the cache; launch turns prefetch and set dueling on when it is partial."""
    facts = launch.load_facts(resolved(model_dir))
    one_layer = launch.plan_for(facts, 1 << 40, 128, 1, None)
    # RAM for the dense part, the KV and the reserve plus six experts per layer: a partial cache.
    ram = one_layer.dense_bytes + one_layer.kv_bytes + one_layer.reserve_bytes + \
        6 * one_layer.expert_bytes * one_layer.moe_layers + 1000
    spec = launch.prepare(resolved(model_dir), ram_gib=ram / launch.GIB, ctx=128, threads=2,
                          streaming=launch.Streaming(io="buffered"))
    assert spec.cap == 6
    # The 1000 spare bytes hold no staging buffer: two slots per layer (3 layers) pay for the minimum of 4 (a
    # buffer is an expert plus 12 KiB of direct-I/O slack), so prefetching stays inside --ram.
    assert spec.argv[spec.argv.index("--cap") + 1] == "4"
    assert spec.argv[spec.argv.index("--io-stages") + 1] == "4"
    assert "--prefetch" in spec.argv and spec.argv[spec.argv.index("--prefetch") + 1] == "on"
    assert any("4 prefetch staging buffers (paid by 2 slot(s) per layer) and 4 cache slots per layer, of which "
               "pinning keeps 2" in note for note in spec.plan.notes)
    assert spec.argv[spec.argv.index("--pin") + 1] == "duel"
    # streaming: the whole 40-token prompt in one pass, so each expert is read once for all its rows
    assert spec.argv[spec.argv.index("--prefill-chunk") + 1] == "128"
    hot = Path(model_dir) / ".colibri-hotset"
    try:
        tokens, logits, stats = run(launch.start(spec), model_dir)
        assert tokens == baseline[0] and logits == baseline[1]
        assert stats["prefetch"] is True and stats["pin"] is True and stats["policy"] == "duel"
        assert 0 <= stats["duel_lru_layers"] <= GEOMETRY["num_layers"]
        assert hot.is_file(), "the hot set is saved next to the model by default"
    finally:
        hot.unlink(missing_ok=True)


def test_hotset_sidecar_is_reloaded_and_refused_for_another_model(binary, model_dir, tmp_path):
    hotset = tmp_path / "hotset"
    pin = ("--pin", "on", "--hotset", str(hotset))
    with engine(binary, model_dir, 4, *pin) as eng:
        assert eng.ready["hotset"] == "none"
        eng.generate(workload(model_dir)[0], max_tokens=2)
    first = hotset.read_text()
    with engine(binary, model_dir, 4, *pin) as eng:
        assert eng.ready["hotset"] == "loaded"
        assert eng.ready["pinned_experts"] > 0, "pins come back from the sidecar before any token"
    other = tiny_model("olmoe", tmp_path / "other", seed=12, **GEOMETRY).path
    with engine(binary, other, 4, *pin) as eng:
        assert eng.ready["hotset"].startswith("ignored") and "another model" in eng.ready["hotset"]
        assert eng.ready["pinned_experts"] == 0
    assert hotset.read_text() != first   # rewritten (atomically) for the model that ran last
    hotset.write_text("colibri-hotset 99 key 0\n")
    with engine(binary, model_dir, 4, *pin) as eng:
        assert "version 99" in eng.ready["hotset"]


def test_lossy_knobs_are_labelled(binary, model_dir):
    tokens, _, stats = run(engine(binary, model_dir, 0, "--experts-k", "2", "--experts-top-p", "0.5"), model_dir)
    assert stats["lossy"] == "experts-k=2 experts-top-p=0.5"
    assert len(tokens) == DECODE
    with pytest.raises(Exception, match="experts-top-p"):
        engine(binary, model_dir, 0, "--experts-top-p", "1.5")
    assert launch.Streaming(experts_k=2, experts_top_p=0.9).lossy_label() == "experts-k=2 experts-top-p=0.9"
    assert launch.Streaming().lossy_label() == ""

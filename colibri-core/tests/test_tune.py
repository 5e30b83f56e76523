"""``coli tune``: the profile it writes, the rules it chooses by, and how ``run``/``serve`` use (or ignore) it.

Timing values are never asserted (speed is measured in benchmarks): only the profile's structure, the choices'
rules on given figures, and the engine arguments a profile leads to."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from colibri import launch, plugins, tune
from colibri.cli import app
from colibri.demo_tokenizer import stdlib_texts, train_bpe
from colibri.model import resolve_model
from colibri.streaming import stats_line

sys.path.insert(0, str(Path(__file__).resolve().parent))  # --import-mode=importlib adds no test dir
from fakefamily import fake_model

MB = 1 << 20


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture
def config(tmp_path, monkeypatch):
    monkeypatch.setenv("COLIBRI_CONFIG", str(tmp_path / "config"))
    return tmp_path / "config"


def points(bandwidths: dict[int, float], direct: bool = False) -> tuple[tune.ReadPoint, ...]:
    return tuple(tune.ReadPoint(d, direct, bw, 0.001, 10) for d, bw in sorted(bandwidths.items()))


def test_tune_writes_a_valid_profile_with_a_tiny_budget(config, tmp_path):
    scratch = tmp_path / "disk"
    res = invoke("tune", "--dir", scratch, "--file-size", "16MiB", "--seconds", "0.2", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    saved = Path(data["profile"])
    assert saved == config / "tune" / f"dev{os.stat(scratch).st_dev}.json" and saved.is_file()
    assert list(scratch.iterdir()) == [], "the temporary file is deleted"
    profile = tune.load_profile(scratch)
    assert profile is not None and profile.as_json() == {k: v for k, v in data.items() if k != "profile"}
    modes = [False, True] if profile.direct_supported else [False]
    assert [(p.direct, p.depth) for p in profile.reads] == [(m, d) for m in modes for d in tune.DEPTHS]
    assert all(p.reads >= p.depth and p.bytes_per_s > 0 for p in profile.reads), "every reader read at least once"
    c = profile.choices
    assert c.io_threads in tune.DEPTHS
    assert c.io in (("buffered", "direct") if profile.direct_supported else ("buffered",))
    chosen = next(p for p in profile.reads if p.depth == c.io_threads and p.direct == (c.io == "direct"))
    assert c.disk_bandwidth == chosen.bytes_per_s
    assert c.staging_buffers == max(4, 2 * c.io_threads)
    assert tune.CHUNK_MIN <= c.prefill_chunk <= tune.CHUNK_MAX and c.prefill_chunk & (c.prefill_chunk - 1) == 0
    assert profile.expert_s > 0 and profile.expert_batch_s > 0 and set(c.rules) == {
        "io_threads", "io", "staging_buffers", "prefill_chunk", "lookahead"}
    text = invoke("tune", "--dir", scratch, "--file-size", "16MiB", "--seconds", "0.2")
    assert text.exit_code == 0 and "I/O threads" in text.stdout and str(saved) in text.stdout


def test_bad_flags_are_one_line(config, tmp_path):
    res = invoke("tune", "--dir", tmp_path, "--file-size", "1MiB", "--seconds", "0.1")
    assert res.exit_code == 1 and "--file-size" in res.output
    res = invoke("tune", "--dir", tmp_path, "--seconds", "0")
    assert res.exit_code == 1 and "--seconds 0" in res.output


def test_io_threads_are_the_shallowest_depth_near_the_fastest():
    flat_after_2 = points({1: 100e6, 2: 190e6, 4: 200e6, 8: 205e6})
    c = tune.choose(flat_after_2, 6 * MB, 1e-4, 3e-3, 64, 8)
    assert (c.io_threads, c.io, c.staging_buffers, c.disk_bandwidth) == (2, "buffered", 4, 190e6)
    # a small step before a big one (this machine's virtual disk, direct): the big one counts
    knee_late = points({1: 697e6, 2: 724e6, 4: 865e6, 8: 850e6})
    assert tune.choose(knee_late, 6 * MB, 1e-4, 3e-3, 64, 8).io_threads == 4
    assert tune.choose(points({1: 100e6, 2: 190e6, 4: 200e6, 8: 400e6}), 6 * MB, 1e-4, 3e-3, 64, 8).io_threads == 8
    growing = points({1: 100e6, 2: 200e6, 4: 400e6, 8: 800e6})
    assert tune.choose(growing, 6 * MB, 1e-4, 3e-3, 64, 8).staging_buffers == 16
    # direct wins where it reads at least as fast at its own knee
    both = points({1: 100e6, 2: 110e6, 4: 111e6, 8: 112e6}) + points({1: 300e6, 2: 310e6, 4: 320e6, 8: 330e6}, True)
    c = tune.choose(both, 6 * MB, 1e-4, 3e-3, 64, 8)
    assert (c.io, c.io_threads, c.disk_bandwidth) == ("direct", 1, 300e6)


def test_lookahead_and_prefill_chunk_follow_the_measured_ratio():
    disk = points({1: 1e9, 2: 1e9, 4: 1e9, 8: 1e9})        # 6 MiB read: about 6.3 ms
    # a layer's routed compute (top-k experts) against a quarter of one read (about 1.6 ms)
    assert not tune.choose(disk, 6 * MB, 1.5e-4, 3e-3, 64, 8).lookahead    # 8 x 0.15 ms = 1.2 ms
    assert tune.choose(disk, 6 * MB, 1.5e-4, 3e-3, 64, 16).lookahead       # 16 x 0.15 ms = 2.4 ms
    assert tune.choose(disk, 6 * MB, 3e-4, 3e-3, 64, 8).lookahead          # 8 x 0.3 ms = 2.4 ms
    # the transfer time at the chosen bandwidth counts, not one read's latency at the chosen depth: the same disk
    # read at depth 2 (each read twice as long, the same bandwidth) gives the same choice
    deep = points({1: 0.5e9, 2: 1e9, 4: 1e9, 8: 1e9})
    assert tune.choose(deep, 6 * MB, 3e-4, 3e-3, 64, 8).io_threads == 2
    assert tune.choose(deep, 6 * MB, 3e-4, 3e-3, 64, 8).lookahead
    assert not tune.choose(deep, 6 * MB, 1.5e-4, 3e-3, 64, 8).lookahead
    chunks = [tune.choose(points({1: bw, 2: bw}), 6 * MB, 1e-3, 32e-3, 64, 8).prefill_chunk
              for bw in (50e9, 5e9, 1e9, 0.2e9, 0.01e9)]
    assert chunks == sorted(chunks) and chunks[0] == tune.CHUNK_MIN and chunks[-1] == tune.CHUNK_MAX


def synthetic_profile(directory: Path, **choices) -> tune.TuneProfile:
    c = replace(tune.choose(points({1: 1e9, 2: 1.5e9, 4: 1.6e9, 8: 1.6e9}), 6 * MB, 2e-3, 3e-3, 64, 8), **choices)
    return tune.TuneProfile(device=os.stat(directory).st_dev, directory=str(directory), measured_on="test",
                            expert_bytes=6 * MB, direct_supported=False, reads=(), expert_s=2e-3,
                            expert_batch_s=3e-3, qpath="scalar", choices=c)


@pytest.fixture(scope="module")
def trained():
    return train_bpe(stdlib_texts(100_000), 400)


@pytest.fixture
def fake(tmp_path, monkeypatch, trained, config):
    from colibri.cachedir import cache_root

    cache = cache_root()
    model = fake_model(tmp_path, monkeypatch, trained)
    monkeypatch.setenv("COLIBRI_CACHE", str(cache))   # the session's: the kernel probe is built once
    monkeypatch.setattr("colibri.sysinfo.cached_read_bandwidth", lambda path: None)   # no earlier measurement
    yield model
    plugins.reset()


def partial_ram_gib(model, rows: int = 0) -> float:
    """A budget whose cache holds 2 of the fake model's 4 experts a layer (``rows``: the prefill chunk asked for,
    which sizes the plan's reserve)."""
    facts = launch.load_facts(model)
    plan = launch.plan_for(facts, 64 << 30, 128, 1, None, rows)
    fixed = plan.dense_bytes + plan.kv_bytes + plan.state_bytes + plan.reserve_bytes
    return (fixed + plan.moe_layers * plan.expert_bytes * 2 + 100) / (1 << 30)


def flag(argv, name):
    return argv[argv.index(name) + 1] if name in argv else None


def test_run_takes_the_profile_and_explicit_flags_win(fake):
    model = resolve_model(str(fake))
    ram = partial_ram_gib(model)
    untuned = launch.prepare(model, ram_gib=ram, ctx=128, threads=1).argv
    assert flag(untuned, "--io-threads") is None and "--lookahead" not in untuned
    profile = synthetic_profile(fake, io_threads=4, staging_buffers=8, prefill_chunk=64, lookahead=True)
    ram = partial_ram_gib(model, rows=64)
    tuned = launch.prepare(model, ram_gib=ram, ctx=128, threads=1, tune=profile).argv
    assert flag(tuned, "--io-threads") == "4" and flag(tuned, "--lookahead") == "on"
    assert flag(tuned, "--prefill-chunk") == "64" and flag(untuned, "--prefill-chunk") == "128"
    explicit = launch.prepare(model, ram_gib=ram, ctx=128, threads=1, tune=profile, io_threads=1,
                              streaming=launch.Streaming(lookahead=False)).argv
    assert flag(explicit, "--io-threads") == "1" and "--lookahead" not in explicit
    resident = launch.prepare(model, ram_gib=64, ctx=128, threads=1, tune=profile).argv
    assert "--lookahead" not in resident and flag(resident, "--io-threads") == "4", "the preload reads with it too"


def test_staging_buffers_from_the_profile_stay_inside_the_plan():
    from colibri.planner import STAGING_SLACK_BYTES, streaming_split
    from colibri.records import ResourcePlan

    profile = synthetic_profile(Path("."), staging_buffers=8, lookahead=True)
    # the profile's 8 buffers, plus one per routed expert of the next layer with lookahead (top-k 8)
    tuned = launch.tuned_streaming(profile, launch.Streaming(), top_k=8, cache_share=0.25)
    assert tuned.streaming.lookahead and tuned.staging_buffers == 16 and tuned.io_threads == profile.choices.io_threads
    plain = launch.tuned_streaming(profile, launch.Streaming(lookahead=False), top_k=2, cache_share=0.25)
    assert plain.staging_buffers == 8 and not plain.streaming.lookahead
    # lookahead only while the cache holds at most half of a layer (where it was measured to pay), never resident
    for share, on in ((0.5, True), (0.75, False), (1.0, False)):
        assert launch.tuned_streaming(profile, launch.Streaming(), 8, share).streaming.lookahead is (on or None)
    assert launch.tuned_streaming(None, launch.Streaming(), 8, 0.25).staging_buffers is None
    expert, layers = 1 << 20, 16
    plan = ResourcePlan(ram_bytes=1000 + 14 * layers * expert + 40 * (expert + STAGING_SLACK_BYTES), dense_bytes=1000,
                        kv_bytes=0, state_bytes=0, reserve_bytes=0, expert_bytes=expert, experts_per_layer=64,
                        moe_layers=layers, cache_slots_per_layer=14, cache_bytes=14 * layers * expert,
                        routed_bytes_per_token=0, disk_bandwidth=0.0, disk_bound_tokens_per_s=0.0, fits=True,
                        min_ram_bytes=0)
    assert streaming_split(plan, 8, 10) == (14, 10) and streaming_split(plan, 8) == (14, 16)


def test_run_reports_the_share_of_the_profiles_disk_bound(fake):
    tune.save_profile(synthetic_profile(fake), fake)
    ram = partial_ram_gib(resolve_model(str(fake)))
    res = invoke("run", "hello", "--model", fake, "--raw", "--max-tokens", 3, "--temp", 0, "--ctx", 128,
                 "--ram", ram, "--json")
    assert res.exit_code == 0, res.output
    stats = json.loads(res.stdout)["stats"]
    routed = launch.prepare(resolve_model(str(fake)), ram_gib=ram, ctx=128).plan.routed_bytes_per_token
    bound = 1.5e9 / ((1 - stats["hit_rate"]) * routed)    # the fake engine's 0.75 hit rate, the profile's 1.5 GB/s
    assert stats["disk_bound_tps"] == pytest.approx(bound)
    assert stats["share_of_disk_bound"] == pytest.approx(stats["decode_tps"] / bound)
    assert stats["disk_bound_source"] == "coli tune at queue depth 2"
    text = invoke("run", "hello", "--model", fake, "--raw", "--max-tokens", 3, "--temp", 0, "--ctx", 128,
                  "--ram", ram)
    assert f"% of the disk bound ({bound:.2f} tok/s at this hit rate)" in text.stderr
    ignored = invoke("run", "hello", "--model", fake, "--raw", "--max-tokens", 3, "--temp", 0, "--ctx", 128,
                     "--ram", ram, "--no-tune-profile", "--json")
    stats = json.loads(ignored.stdout)["stats"]
    assert stats["disk_bound_tps"] is None and stats["disk_bound_source"].startswith("unknown")
    assert "disk bound unknown (run coli tune)" in stats_line(stats)


def test_a_corrupt_profile_is_ignored_with_one_warning(fake, capsys):
    path = tune.profile_path(fake)
    path.parent.mkdir(parents=True)
    for body in ("{not json", json.dumps({"version": 1, "choices": {}}), json.dumps([1, 2])):
        path.write_text(body)
        assert tune.load_profile(fake) is None
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and str(path) in err[0] and "coli tune" in err[0]
    good = synthetic_profile(fake)
    tune.save_profile(good, fake)
    assert tune.load_profile(fake) == good and not list(path.parent.glob("*.tmp*"))


def test_tune_on_a_model_reads_its_own_shards_and_run_picks_the_profile_up(fake):
    shards = {p: p.read_bytes() for p in fake.glob("*.safetensors")}
    res = invoke("tune", "--model", fake, "--seconds", "0.2", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert Path(data["measured_on"]) in shards and data["directory"] == str(fake)
    assert {p: p.read_bytes() for p in fake.glob("*.safetensors")} == shards, "the shards are only read"
    assert Path(data["profile"]) == tune.profile_path(fake)
    ram = partial_ram_gib(resolve_model(str(fake)))
    run = invoke("run", "hello", "--model", fake, "--raw", "--max-tokens", 2, "--temp", 0, "--ctx", 128,
                 "--ram", ram, "--json")
    stats = json.loads(run.stdout)["stats"]
    assert stats["disk_bound_source"] == f"coli tune at queue depth {data['choices']['io_threads']}"
    assert invoke("tune", "--model", fake, "--dir", fake).exit_code == 1


class _Stop(Exception):
    pass


@pytest.mark.parametrize("flags, tuned", [((), True), (("--no-tune-profile",), False)])
def test_serve_takes_the_profile_for_its_engine_and_disk_bound(fake, monkeypatch, flags, tuned):
    tune.save_profile(synthetic_profile(fake, io_threads=4, lookahead=True), fake)
    seen = {}

    def config(**kwargs):
        seen.update(kwargs)
        raise _Stop

    def prepare(*args, **kwargs):
        seen["spec"] = real_prepare(*args, **kwargs)
        return seen["spec"]

    real_prepare = launch.prepare
    monkeypatch.setattr(launch, "prepare", prepare)
    monkeypatch.setattr("colibri.cli.serve.bind_socket", lambda host, port: None)
    monkeypatch.setattr("colibri.server.ServerConfig", config)
    res = CliRunner().invoke(app, ["serve", "--model", str(fake), "--ctx", "128", "--kv-slots", "1", "--ram",
                                   str(partial_ram_gib(resolve_model(str(fake)))), *flags])
    assert "_Stop" in res.output and "disk_bandwidth" in seen, res.output   # stopped before anything listens
    argv = seen["spec"].argv
    if tuned:
        assert flag(argv, "--io-threads") == "4" and flag(argv, "--lookahead") == "on", " ".join(argv)
        assert seen["disk_bandwidth"] == 1.5e9 and seen["disk_bandwidth_source"] == "coli tune at queue depth 4"
    else:
        assert "--io-threads" not in argv and "--lookahead" not in argv
        assert seen["disk_bandwidth"] == 0 and seen["disk_bandwidth_source"].startswith("unknown")

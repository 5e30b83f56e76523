"""Conversations that survive restarts, on real engines: a turn saves its slot (kv_save), a new engine process
loads it (kv_load) and prefills only what is new, and its greedy tokens are those of a fresh full prefill and of
transformers — for one family of each attention kind, with one expert slot per layer (every expert evicted).

Also: corrupt, truncated, foreign and hostile files are refused by the engine with a warning and the request is
still right; the store keeps its disk budget over 50 conversations. Engines restart in-process (a new engine
process is what a server restart gives the engine side); tests/test_kv_serve.py goes through ``coli serve``.
"""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

import pytest

from colibri import launch
from colibri.kv_store import HEADER, KVStore, read_saved
from colibri.model import resolve_model
from colibri.testing.parity import MIN_MARGIN, reference_run, seeded_prompt

CTX = 256
GEN = 8
EXTRA = [11, 12, 13, 14, 15]       # the next user message's tokens

# family kind -> (attention kind, the package that runs it)
FAMILIES = {
    "olmoe": ("GQA", "colibri_olmoe"),
    "deepseek_v3": ("MLA", "colibri_deepseek_v4"),
    "deepseek_v32": ("MLA+DSA", "colibri_deepseek_v4"),
    "qwen3_next": ("DeltaNet hybrid", "colibri_qwen"),
    "kimi_linear": ("KDA hybrid", "colibri_kimi"),
}


# deepseek_v32 as its own parity test runs it sparse: 8 of the ~60 positions selected, so the loaded index keys
# decide what every new query attends to
OVERRIDES = {"deepseek_v32": dict(index_topk=8, index_n_heads=8)}


def spec_of(kind: str, root: Path, seed: int = 0):
    pytest.importorskip(FAMILIES[kind][1])
    from colibri.testing.tiny import tiny_model

    built = tiny_model(kind, root, seed=seed, **OVERRIDES.get(kind, {}))
    return built, launch.prepare(resolve_model(str(built.path)), ctx=CTX, cap=1, threads=1)


def turn(spec, prompt, kv=None, store=None, **fields):
    """One request on a freshly started engine (a restart before every turn)."""
    with launch.start(spec, kv=kv, store=store) as engine:
        return engine.generate(prompt, max_tokens=GEN, **fields)


def hf_greedy(path: Path, prompt: list[int]) -> list[int] | None:
    """transformers' greedy continuation, or None when it has a near-tie (a flip under float noise)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    _, tokens, margin = reference_run(model, prompt, GEN)
    return tokens if margin >= MIN_MARGIN else None


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_second_turn_after_restart_prefills_only_the_new_tokens(kind, tiny_root, tmp_path):
    built, spec = spec_of(kind, tiny_root)
    kv = launch.KVOptions(directory=str(tmp_path / "kv"))
    store = launch.kv_store_for(spec, kv)
    vocab = int(spec.facts.geometry.vocab_size)
    first = seeded_prompt(3, vocab)
    one = turn(spec, first, kv, store)
    saved = len(first) + GEN - 1        # the last sampled token is not fed yet
    assert one.stats["kv_saved_tokens"] == saved and one.stats["prefilled_tokens"] == len(first)
    assert one.stats["expert_misses"] > 0

    # A reply re-tokenized differently: only the prompt part is shared. A recurrent state restores from the
    # end-of-prompt checkpoint the file keeps; attention takes the shared rows.
    branch = first + [2 if one.tokens[0] != 2 else 3] + EXTRA
    other = turn(spec, branch, kv, store)
    assert other.accept["kv_loaded"] == len(first)
    assert other.stats["prefilled_tokens"] == len(branch) - len(first)
    assert other.tokens == turn(spec, branch).tokens

    second = first + one.tokens + EXTRA
    two = turn(spec, second, kv, store)
    assert "kv_warning" not in two.accept
    assert two.accept["kv_loaded"] == saved
    assert two.stats["prefilled_tokens"] == len(second) - saved == len(EXTRA) + 1
    fresh = turn(spec, second)
    assert fresh.stats["prefilled_tokens"] == len(second)
    assert two.tokens == fresh.tokens
    reference = hf_greedy(built.path, second)
    assert reference is not None, "the seeded prompt has a near-tie in transformers: pick another seed"
    assert two.tokens == reference
    # the second save extends the first, which is then superseded
    files = sorted(store.directory.glob("*.kv"))
    assert sorted(read_saved(f).n_tokens for f in files) == sorted([len(branch) + GEN - 1, len(second) + GEN - 1])


def damaged(src: Path, dst: Path, how: str) -> Path:
    data = bytearray(src.read_bytes())
    if how == "corrupt":
        data[HEADER.size + 4 * 50 + 7] ^= 0x10          # one bit of a KV row
    elif how == "truncated":
        del data[-100:]
    elif how == "hostile":
        # a header that claims 2^31 tokens with a payload size to match: must be refused before any allocation
        fields = list(HEADER.unpack_from(data))
        fields[8] = 1 << 31
        fields[12] = (1 << 62)
        data[:HEADER.size] = HEADER.pack(*fields)
    elif how == "header_bit":
        data[HEADER.size - 9] ^= 1                      # payload_bytes' top byte: sizes disagree
    dst.write_bytes(bytes(data))
    return dst


@pytest.mark.parametrize("kind", ["olmoe", "qwen3_next"])
@pytest.mark.parametrize("how", ["corrupt", "truncated", "hostile", "header_bit", "foreign"])
def test_bad_files_are_ignored_with_a_warning(kind, how, tiny_root, tmp_path):
    _, spec = spec_of(kind, tiny_root)
    kv = launch.KVOptions(directory=str(tmp_path / "kv"))
    store = launch.kv_store_for(spec, kv)
    first = seeded_prompt(5, int(spec.facts.geometry.vocab_size))
    if how == "foreign":    # same architecture and geometry, other weights
        _, other_spec = spec_of(kind, tiny_root, seed=1)
        other = launch.kv_store_for(other_spec, kv)
        assert other.identity != store.identity
        one = turn(other_spec, first, kv, other)
        src = next(other.directory.glob("*.kv"))
    else:
        one = turn(spec, first, kv, store)
        src = next(store.directory.glob("*.kv"))
    second = first + one.tokens + EXTRA
    bad = src if how == "foreign" else damaged(src, tmp_path / "bad.kv", how)
    # the engine, handed the file directly, refuses it and prefills everything
    with launch.start(spec, kv=kv, store=store) as engine:
        result = engine.generate(second, max_tokens=GEN, kv_load=str(bad), kv_save=str(tmp_path / "new.kv"),
                                 kv_identity=store.identity)
    assert result.accept["kv_loaded"] == 0 and result.accept["reused_tokens"] == 0
    reason = {"corrupt": "checksum mismatch", "truncated": "truncated", "hostile": "token count",
              "header_bit": "payload size", "foreign": "another model"}[how]
    assert reason in result.accept["kv_warning"] and str(bad) in result.accept["kv_warning"]
    assert result.stats["prefilled_tokens"] == len(second)
    assert result.tokens == turn(spec, second).tokens
    # through the store: a damaged file in the directory never makes a request wrong
    if how != "foreign":
        shutil.copy(bad, src)
        again = turn(spec, second, kv, store)
        assert again.tokens == result.tokens and again.accept.get("kv_loaded", 0) == 0


def test_disk_budget_holds_over_50_conversations(tiny_root, tmp_path):
    _, spec = spec_of("olmoe", tiny_root)
    probe = launch.KVOptions(directory=str(tmp_path / "probe"))
    with launch.start(spec, kv=probe) as engine:
        size = engine.generate(seeded_prompt(0, 512, 20), max_tokens=2).stats["kv_saved_bytes"]
    budget = 6 * size
    kv = launch.KVOptions(directory=str(tmp_path / "kv"), budget=budget)
    store = launch.kv_store_for(spec, kv)
    with launch.start(spec, kv=kv, store=store) as engine:
        for i in range(50):
            engine.reset(0)
            result = engine.generate(seeded_prompt(100 + i, 512, 20), max_tokens=2)
            assert result.stats["kv_saved_bytes"] == size
            on_disk = sum(f.stat().st_size for f in store.directory.glob("*.kv"))
            assert on_disk <= budget
    names = sorted(store.directory.glob("*.kv"))
    assert len(names) == 6
    # the survivors are the most recent conversations: the last one's prompt finds its own file
    last = seeded_prompt(149, 512, 20)
    assert any(read_saved(f).tokens[:20] == tuple(last) for f in names)


def test_store_prefers_what_the_engine_can_use(tmp_path):
    """The lookup mirrors engine.c's rule: a recurrent state restores only at the file's end or its checkpoint."""
    store = KVStore(tmp_path, "x" * 64)
    store.directory.mkdir(parents=True)

    def write(name: str, tokens: list[int], snap: int, state: int) -> None:
        payload = 4 * len(tokens) + 2 * state
        header = HEADER.pack(b"COLIKV\r\n", 1, HEADER.size, b"fam", b"x" * 64, 1, 1, 1, len(tokens), snap, 0,
                             state, payload, 0)
        (store.directory / name).write_bytes(header + struct.pack(f"<{len(tokens)}i", *tokens) + b"\0" * 2 * state)

    write("a.kv", [1, 2, 3, 4, 5, 6], 3, 8)
    write("b.kv", [1, 2, 3, 4], 0, 8)
    plan = store.plan([1, 2, 3, 4, 5, 9, 9])
    assert plan is not None and plan.load == store.directory / "b.kv" and plan.load_covers == 4
    plan = store.plan([1, 2, 9])          # "a" only at its checkpoint (3) is past what is shared
    assert plan is not None and plan.load is None
    plan = store.plan([1, 2, 3, 4, 5, 9, 9], ctx=5)      # the engine would refuse files past its context
    assert plan is not None and plan.load == store.directory / "b.kv"
    plan = store.plan([1, 2, 3, 4, 5, 9, 9], ctx=3)
    assert plan is not None and plan.load is None

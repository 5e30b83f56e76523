"""The real releases colibri plans for, as header-only layouts built from their config.json.

Each entry names where its config.json is recorded (the family package's own test, which checks the family reads
it, or ``tests/fixtures/real_configs/``) and the publisher's parameter figures. ``python tests/real_layouts.py``
regenerates docs/models.md from these layouts (RAM, disk per container scheme, disk-bound decode speed), so no
number in that table is typed by hand.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "real_configs"
GIB = 1024 ** 3
SCHEMES = (None, ("int8", "bf16"), ("int4", "int8"))     # as shipped, then the two containers colibri recommends
BANDWIDTHS = (2e9, 7e9)


@dataclass(frozen=True)
class Release:
    name: str
    repo: str
    source: str              # "package/tests/test_x.py:NAME" or a fixture file name
    total: float             # published parameters (the model card's figure)
    active: float
    citation: str


RELEASES = (
    Release("GLM-5", "zai-org/GLM-5", "colibri-glm/tests/test_glm_plugin.py:GLM5", 744e9, 40e9,
            "z.ai GLM-5 announcement: 744B parameters, 40B active"),
    Release("GLM-4.7-Flash", "zai-org/GLM-4.7-Flash", "colibri-glm/tests/test_glm_plugin.py:GLM47_FLASH", 30e9, 3e9,
            "model card: a 30B-A3B MoE"),
    Release("DeepSeek-V3", "deepseek-ai/DeepSeek-V3",
            "colibri-deepseek-v4/tests/test_deepseek_v4_plugin.py:DEEPSEEK_V3", 671e9, 37e9,
            "DeepSeek-V3 technical report / README_WEIGHTS.md: 671B total, 37B activated"),
    Release("DeepSeek-V3.2", "deepseek-ai/DeepSeek-V3.2",
            "colibri-deepseek-v4/tests/test_deepseek_v4_plugin.py:DEEPSEEK_V32", 671e9, 37e9,
            "model card: the V3 architecture (671B, 37B activated) plus the DSA indexer"),
    Release("DeepSeek-V4-Flash", "deepseek-ai/DeepSeek-V4-Flash",
            "colibri-deepseek-v4/tests/test_deepseek_v4_plugin.py:DEEPSEEK_V4", 284e9, 13e9,
            "model card: 284B total, 13B activated"),
    Release("Kimi K2", "moonshotai/Kimi-K2-Instruct", "colibri-kimi/tests/test_kimi_plugin.py:KIMI_K2", 1.0e12, 32e9,
            "model card: 1 trillion total, 32 billion activated parameters"),
    Release("Kimi Linear", "moonshotai/Kimi-Linear-48B-A3B-Instruct",
            "colibri-kimi/tests/test_kimi_plugin.py:KIMI_LINEAR", 48e9, 3e9, "model card: 48B total, 3B activated"),
    Release("Qwen3-235B-A22B", "Qwen/Qwen3-235B-A22B", "Qwen3-235B-A22B.json", 235e9, 22e9,
            "model card: 235B total, 22B activated"),
    Release("Qwen3-Next-80B-A3B", "Qwen/Qwen3-Next-80B-A3B-Instruct",
            "colibri-qwen/tests/test_qwen_plugin.py:QWEN3_NEXT_80B", 80e9, 3e9, "model card: 80B total, 3B activated"),
    Release("Qwen3.5-35B-A3B", "Qwen/Qwen3.5-35B-A3B", "colibri-qwen/tests/test_qwen_plugin.py:QWEN35_35B", 35e9, 3e9,
            "model card: 35B total, 3B activated"),
    Release("Qwen3-30B-A3B", "Qwen/Qwen3-30B-A3B", "colibri-qwen/tests/test_qwen_plugin.py:QWEN3_30B_A3B",
            30.5e9, 3.3e9, "model card: 30.5B total, 3.3B activated"),
    Release("OLMoE-1B-7B", "allenai/OLMoE-1B-7B-0924", "colibri-olmoe/tests/test_olmoe_plugin.py:OLMOE_1B_7B",
            6.9e9, 1.3e9, "OLMoE paper / model card: 6.9B total, 1.3B active"),
)
BY_NAME = {r.name: r for r in RELEASES}


def config_of(release: Release) -> dict:
    if ":" not in release.source:
        return json.loads((FIXTURES / release.source).read_text(encoding="utf-8"))
    path, name = release.source.split(":")
    spec = importlib.util.spec_from_file_location(f"_real_config_{name.lower()}", ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return dict(getattr(module, name))


# Real Kimi K2 configs name their own type; transformers builds them as DeepSeek-V3.
BUILD_AS = {"kimi_k2": "deepseek_v3"}
# The model types whose releases ship their multi-token-prediction layers (DeepSeek-V3's README_WEIGHTS.md).
SHIPS_MTP = ("deepseek_v3",)


def build(release: Release, directory: Path) -> Path:
    """The release's header-only layout in ``directory`` (config.json, sparse shards, index)."""
    from colibri.testing.header_layout import write_layout

    config = config_of(release)
    model_type = config.get("model_type")
    return write_layout(config, directory, build_as=BUILD_AS.get(model_type), mtp=model_type in SHIPS_MTP)


@lru_cache(maxsize=None)
def _facts(path: str):
    from colibri.inventory import load_facts
    from colibri.model import resolve_model

    return load_facts(resolve_model(path))


def figures(directory: Path) -> dict:
    """What docs/models.md shows for one layout: parameters, and per scheme disk, RAM and disk-bound speed."""
    from colibri.cli.inspect import make_plan
    from colibri.inventory import take_inventory
    from colibri.projection import project
    from colibri.records import PlanRequest

    facts = _facts(str(directory))
    inv = take_inventory(facts.geometry, facts.layout, facts.tensors)
    out = {"total": inv.total_params, "active": inv.active_params, "schemes": []}
    for scheme in SCHEMES:
        if scheme is None:
            planned, disk = facts, sum(h.file_size for h in facts.tensors.headers)
        else:
            projected = project(facts, *scheme)
            planned, disk = projected.facts, projected.container_bytes
        speeds = [make_plan(planned, PlanRequest(GIB, 4096, 1, bw, 0)).disk_bound_tokens_per_s for bw in BANDWIDTHS]
        plan = make_plan(planned, PlanRequest(GIB, 4096, 1, BANDWIDTHS[0], 0))
        out["schemes"].append({"scheme": scheme, "disk_bytes": disk, "min_ram_bytes": plan.min_ram_bytes,
                               "expert_bytes": plan.expert_bytes, "tokens_per_s": speeds})
    return out


def _scheme_label(scheme) -> str:
    return "as shipped" if scheme is None else f"experts {scheme[0]}, dense {scheme[1]}"


def table_row(release: Release, data: dict) -> str:
    cells = [f"[{release.name}](https://huggingface.co/{release.repo})",
             f"{data['total'] / 1e9:.1f}B / {data['active'] / 1e9:.1f}B"]
    for s in data["schemes"]:
        cells.append(f"{s['disk_bytes'] / GIB:.0f} GiB, RAM {s['min_ram_bytes'] / GIB:.1f} GiB, "
                     f"{s['tokens_per_s'][0]:.2f} / {s['tokens_per_s'][1]:.2f} tok/s")
    return "| " + " | ".join(cells) + " |"


HEADER = """# Models: what each real release needs

Generated by `nox -s real_layouts -- --write-docs` (`python tests/real_layouts.py`) from header-only layouts of
each release (its config.json, every tensor's real name, shape and dtype from transformers' own model definition,
FP8 block scales where the recorded config.json declares FP8; see `colibri/testing/header_layout.py`). Nothing here
is typed by hand; the tests check the rows. Kimi K2 and DeepSeek-V4-Flash ship quantized experts, but the configs
recorded here carry no `quantization_config`, so their "as shipped" column is the BF16 equivalent.

Per container scheme: the disk it takes, the smallest RAM colibri can run it in (dense weights resident, KV for
4096 tokens of context in one slot, the reserve, one expert cache slot per MoE layer: `coli plan` prints the same
number as *minimum RAM*), and the disk-bound decode speed when every routed expert misses the cache, at 2 and
7 GB/s of disk read bandwidth (a warm cache does better: hits cost no read). "as shipped" is the release as it
downloads; the other two are the containers `coli convert --experts E --dense D` writes (projected exactly with
convert's own plan: `coli plan --experts E --dense D`). Parameters are counted from the headers (total / active per
token; multi-token-prediction layers are not counted).

| model | parameters | as shipped | experts int8, dense bf16 | experts int4, dense int8 |
|---|---|---|---|---|
"""


def stand_in_tokenizer():
    """A small BPE for the layouts, which ship no tokenizer of their own: doctor (which a projection runs) wants one,
    and nothing here tokenizes."""
    from colibri.demo_tokenizer import stdlib_texts, train_bpe

    return train_bpe(stdlib_texts(50_000), 300)


def main(out: Path) -> None:
    import tempfile

    from colibri.demo_tokenizer import write_tokenizer_files

    rows, tokenizer = [], stand_in_tokenizer()
    with tempfile.TemporaryDirectory() as tmp:
        for release in RELEASES:
            directory = build(release, Path(tmp) / release.name)
            write_tokenizer_files(directory, tokenizer)
            rows.append(table_row(release, figures(directory)))
            print(rows[-1], flush=True)
    out.write_text(HEADER + "\n".join(rows) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs" / "models.md")

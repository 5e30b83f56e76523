"""One test per hook (``test_hook_<name>``): the family's answer is used, core's default applies otherwise,
and model hooks are answered only by the family that claimed the model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from colibri import hookimpl, plugins
from colibri.checkpoint import TensorIndex
from colibri.doctor import family_source
from colibri.errors import ConfigError, FamilyError
from colibri.inventory import geometry_of, load_facts
from colibri.model import resolve_model
from colibri.records import (
    Claim,
    ConverterSpec,
    EngineEnv,
    EngineSource,
    FamilyDescriptor,
    Limits,
    PlanRequest,
    PreTokenizerSplit,
    ShardSet,
)


class Other:
    """A second family that answers every model hook with junk: it must never be consulted for OLMoE."""

    @hookimpl
    def describe_family(self):
        return FamilyDescriptor("other", ("othermoe",), "another family")

    @hookimpl
    def detect_config(self, model_dir, config):
        return Claim("other", "othermoe") if config and config.get("model_type") == "othermoe" else None

    @hookimpl
    def model_geometry(self, model):
        raise AssertionError("asked the wrong family")

    @hookimpl
    def tensor_layout(self, model):
        raise AssertionError("asked the wrong family")

    @hookimpl
    def limits(self, model):
        raise AssertionError("asked the wrong family")

    @hookimpl
    def engine_source(self):
        return EngineSource("colibri-other", (Path("/nonexistent/other.c"),))

    @hookimpl
    def build_env(self, model, plan):
        raise AssertionError("asked the wrong family")


@pytest.fixture
def two_families(olmoe_family):
    plugins.register(Other(), "other")
    return olmoe_family


@pytest.fixture
def olmoe(two_families, tiny_olmoe):
    return resolve_model(tiny_olmoe.path)


def test_hook_describe_family(two_families):
    answers = plugins.manager().hook.describe_family()
    by_name = {d.name: d for d in answers}
    assert by_name["testolmoe"].model_types == ("olmoe",)
    assert by_name["other"].model_types == ("othermoe",)


def test_hook_detect_config(two_families, tiny_olmoe, tmp_path):
    config = json.loads((tiny_olmoe.path / "config.json").read_text())
    claims = [c for c in plugins.manager().hook.detect_config(model_dir=tiny_olmoe.path, config=config) if c]
    assert claims == [Claim("testolmoe", "olmoe", "model_type")]

    class MarkerFamily:
        """Claims directories without config.json by a marker file, as pipeline families do."""

        @hookimpl
        def detect_config(self, model_dir, config):
            return Claim("marker", "pipeline") if config is None and (model_dir / "model_index.json").exists() \
                else None

    plugins.register(MarkerFamily(), "marker")
    (tmp_path / "model_index.json").write_text("{}")
    model = resolve_model(tmp_path)
    assert (model.family, model.model_type, dict(model.config)) == ("marker", "pipeline", {})


def test_hook_model_geometry(olmoe, family_class):
    geometry = plugins.family_hook("testolmoe", "model_geometry")(model=olmoe)
    assert geometry.num_experts == olmoe.config["num_experts"] and geometry.top_k == olmoe.config[
        "num_experts_per_tok"]

    class NoGeometry:
        @hookimpl
        def detect_config(self, model_dir, config):
            return Claim("nogeo", "olmoe")

    plugins.reset()
    plugins.register(NoGeometry(), "nogeo")
    with pytest.raises(FamilyError, match="does not describe the geometry") as err:
        geometry_of(resolve_model(olmoe.path))
    assert "model_geometry" in err.value.hint


def test_hook_tensor_layout(olmoe):
    layout = plugins.family_hook("testolmoe", "tensor_layout")(model=olmoe)
    layers, experts = olmoe.config["num_hidden_layers"], olmoe.config["num_experts"]
    assert len(layout.experts) == layers * experts and len(layout.routers) == layers
    index = load_facts(olmoe).tensors
    assert all(name in index for ex in layout.experts for name in ex.tensors)


def test_hook_weight_files(olmoe_family, olmoe_copy, surgery, family_class):
    model = resolve_model(olmoe_copy)
    (single,) = plugins.family_hook("testolmoe", "weight_files")(model=model)
    assert single.files == (olmoe_copy / "model.safetensors",) and single.index_file is None
    surgery.shard(olmoe_copy, 2)
    (sharded,) = plugins.family_hook("testolmoe", "weight_files")(model=model)
    assert sharded.index_file == olmoe_copy / "model.safetensors.index.json" and len(sharded.files) == 2

    class Prefixed(family_class):
        @hookimpl
        def weight_files(self, model):
            return (ShardSet(model.path, tuple(sorted(model.path.glob("*.safetensors"))), None, "lm/"),)

    plugins.reset()
    plugins.register(Prefixed(), "testolmoe")
    (custom,) = plugins.family_hook("testolmoe", "weight_files")(model=model)
    assert custom.prefix == "lm/" and "lm/model.norm.weight" in TensorIndex((custom,))


def test_hook_limits(olmoe):
    limits = plugins.family_hook("testolmoe", "limits")(model=olmoe)
    assert isinstance(limits, Limits) and limits.max_context == olmoe.config["max_position_embeddings"]
    with pytest.raises(AssertionError, match="wrong family"):  # family_hook really routes by family
        plugins.family_hook("other", "limits")(model=olmoe)


def test_hook_engine_source(two_families):
    assert family_source("other") == EngineSource("colibri-other", (Path("/nonexistent/other.c"),))
    assert family_source("testolmoe") is None  # never another family's answer


def test_hook_engine_path(olmoe, family_class, tmp_path):
    binary = tmp_path / "colibri-prebuilt"

    class Prebuilt(family_class):
        @hookimpl
        def engine_path(self, model):
            return binary

    plugins.reset()
    plugins.register(Prebuilt(), "testolmoe")
    assert plugins.family_hook("testolmoe", "engine_path")(model=olmoe) == binary


def test_hook_build_env(olmoe, family_class):
    plan = load_plan(olmoe)
    assert plugins.family_hook("testolmoe", "build_env")(model=olmoe, plan=plan) == EngineEnv()

    class WithEnv(family_class):
        @hookimpl
        def build_env(self, model, plan):
            return EngineEnv(args=("--set", f"experts={model.config['num_experts']}"))

    plugins.reset()
    plugins.register(WithEnv(), "testolmoe")
    env = plugins.family_hook("testolmoe", "build_env")(model=olmoe, plan=plan)
    assert env.args == ("--set", f"experts={olmoe.config['num_experts']}")


def test_hook_plan_resources_only_the_claiming_family(olmoe):
    """(the planner arithmetic is in test_planner.py) the other family's plan_resources is never consulted."""
    plan = load_plan(olmoe)
    assert plan.moe_layers == olmoe.config["num_hidden_layers"]


def test_hook_converter_spec(olmoe, family_class):
    spec = plugins.family_hook("testolmoe", "converter_spec")(model=olmoe)
    assert isinstance(spec, ConverterSpec)
    assert "model.embed_tokens.weight" in spec.dense_matrices
    assert not any(".mlp.gate." in n or "norm" in n for n in spec.dense_matrices)

    class Restricted(family_class):
        @hookimpl
        def converter_spec(self, model):
            return ConverterSpec(expert_schemes=("int8",), dense_schemes=(), dense_matrices=())

    plugins.reset()
    plugins.register(Restricted(), "testolmoe")
    assert plugins.family_hook("testolmoe", "converter_spec")(model=olmoe).expert_schemes == ("int8",)


def test_hook_load_tokenizer(olmoe, family_class):
    tokenizer = plugins.family_hook("testolmoe", "load_tokenizer")(model=olmoe)
    ids = tokenizer.encode("hello world", add_special_tokens=False)
    assert ids and all(isinstance(i, int) for i in ids)
    assert tokenizer.decode(ids) == "hello world"

    sentinel = object()

    class OwnTokenizer(family_class):
        @hookimpl
        def load_tokenizer(self, model):
            return sentinel

    plugins.reset()
    plugins.register(OwnTokenizer(), "testolmoe")
    assert plugins.family_hook("testolmoe", "load_tokenizer")(model=olmoe) is sentinel


def bpe_files(directory: Path, tokenizer_class: str) -> Path:
    """vocab.json + merges.txt of a byte-level BPE that merges "ab" and "12", saved by ``tokenizer_class``."""
    directory.mkdir()
    vocab = {"a": 0, "b": 1, "1": 2, "2": 3, "ab": 4, "12": 5, "Ġ": 6}
    (directory / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (directory / "merges.txt").write_text("#version: 0.2\na b\n1 2\n", encoding="utf-8")
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": tokenizer_class}),
                                                     encoding="utf-8")
    return directory


def test_hook_byte_level_split(two_families, tmp_path):
    from colibri.tokenizer import load_tokenizer_dir

    # core's default knows GPT-2's classes: its own split keeps "ab" and "12" whole, so both merge
    assert load_tokenizer_dir(bpe_files(tmp_path / "gpt2", "GPT2TokenizerFast")).encode("ab12") == [4, 5]
    # a class no installed family knows is refused in one line naming it, with the command that writes
    # tokenizer.json
    unknown = bpe_files(tmp_path / "split", "OneByOneTokenizer")
    with pytest.raises(ConfigError, match="OneByOneTokenizer and no tokenizer.json") as refused:
        load_tokenizer_dir(unknown)
    assert "save_pretrained" in refused.value.hint and "\n" not in str(refused.value)

    class OneByOne:
        """A family that knows the class: every character is a piece, so nothing merges (asked by any family:
        the class is a file format, not the claimed model's)."""

        @hookimpl
        def byte_level_split(self, tokenizer_class):
            return PreTokenizerSplit(pattern=".", nfc=True) if tokenizer_class == "OneByOneTokenizer" else None

    plugins.register(OneByOne(), "onebyone")
    assert load_tokenizer_dir(unknown).encode("ab12") == [0, 1, 2, 3]
    assert load_tokenizer_dir(tmp_path / "gpt2").encode("ab12") == [4, 5]   # its answer is None: core's stands


def load_plan(model):
    facts = load_facts(model)
    return plugins.family_hook(model.family, "plan_resources")(
        model=model, request=PlanRequest(1 << 30, 128), geometry=facts.geometry, layout=facts.layout,
        tensors=facts.tensors)


def test_hook_engine_source_per_model(olmoe, family_class, tiny_olmoe):
    """A family with two compositions names the one the model needs; without a model, its main engine."""
    from colibri import builder, hooks

    mla = EngineSource("colibri-two-mla", (Path("/nonexistent/mla.c"),))
    linear = EngineSource("colibri-two-linear", (Path("/nonexistent/linear.c"),))

    class TwoCompositions(family_class):
        @hookimpl
        def engine_source(self, model):
            if model is None:
                return mla
            return linear if model.config.get("num_experts") == olmoe.config["num_experts"] else None

    plugins.reset()
    plugins.register(TwoCompositions(), "testolmoe")
    assert hooks.engine_source(olmoe) == linear
    assert hooks.family_engine_source("testolmoe") == mla
    assert builder.family_engine_source("testolmoe") == mla
    assert "colibri-two-linear is missing" in builder.engine_status("testolmoe", olmoe)[2]   # this model's source


def test_typed_facade_answers_like_the_hooks(olmoe):
    from colibri import hooks

    assert hooks.tensor_layout(olmoe) == plugins.family_hook("testolmoe", "tensor_layout")(model=olmoe)
    assert hooks.limits(olmoe) == plugins.family_hook("testolmoe", "limits")(model=olmoe)
    assert hooks.build_env(olmoe, load_plan(olmoe)) == EngineEnv()
    assert hooks.engine_path(olmoe) is None                      # no default: core builds engine_source instead
    assert hooks.describe_family("other").model_types == ("othermoe",)


def test_a_claim_must_name_its_own_entry_point(no_installed_plugins, tiny_olmoe):
    class Misnamed:
        @hookimpl
        def detect_config(self, model_dir, config):
            return Claim("olmoe", "olmoe") if config and config.get("model_type") == "olmoe" else None

    plugins.register(Misnamed(), "misnamed")
    with pytest.raises(FamilyError, match="'misnamed' claims .* as family 'olmoe'") as err:
        resolve_model(tiny_olmoe.path)
    assert "entry-point name" in err.value.hint


def test_coli_families_lists_a_misnamed_descriptor_as_broken(no_installed_plugins):
    from colibri.cli.families import family_rows

    class Misnamed:
        @hookimpl
        def describe_family(self):
            return FamilyDescriptor("olmoe", ("olmoe",))

    plugins.register(Misnamed(), "misnamed")
    (row,) = family_rows()
    assert row["status"] == "broken" and "entry point is 'misnamed'" in row["error"]


def test_limits_leave_max_context_to_the_geometry(olmoe):
    """A family states the model's context once (Geometry.max_context); Limits.max_context 0 defers to it."""
    from colibri.errors import UsageError
    from colibri.launch import check_limits

    limits = Limits(has_engine=True)
    check_limits(olmoe, limits, 4096, 1, model_context=4096)
    with pytest.raises(UsageError, match="--ctx 4097 exceeds the 4096 tokens"):
        check_limits(olmoe, limits, 4097, 1, model_context=4096)
    check_limits(olmoe, limits, 1 << 20, 1)                       # nothing known: nothing to refuse


def test_hook_render_prompt_default_renders_the_checkpoint_template(olmoe_family, tiny_olmoe):
    """A family that does not answer render_prompt gets core's: the checkpoint's chat template, with the request's
    template options, and the renderer's own variables are not the request's to replace. (Each family's template
    style against transformers' rendering: tests/test_tool_prompts.py.)"""
    from colibri import hooks
    from colibri.errors import UsageError

    model = resolve_model(tiny_olmoe.path)
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hi"}]
    with_prompt = hooks.render_prompt(model, messages, None, {"add_generation_prompt": True})
    assert with_prompt == "<|system|>\nBe terse.\n<|user|>\nhi\n<|assistant|>\n"
    assert hooks.render_prompt(model, messages, None, {"add_generation_prompt": False}) == with_prompt.removesuffix(
        "<|assistant|>\n")
    with pytest.raises(UsageError, match="'messages'"):
        hooks.render_prompt(model, messages, None, {"template_kwargs": {"messages": []}})


def test_hook_parse_output_has_no_core_default_and_routes_to_the_family(olmoe, family_class):
    """(every real family's syntax, chunked every way: tests/test_output_parser.py)"""
    from colibri import hooks
    from colibri.output_parser import CONTENT, REASONING, OutputParser, OutputSyntax, ToolCall, ToolSection

    assert hooks.parse_output(olmoe) is None          # no core default: the reply is plain answer text

    def decode(body, schemas):
        call = json.loads(body)
        return [ToolCall(call["name"], json.dumps(call["arguments"]))]

    syntax = OutputSyntax("<think>", "</think>", (ToolSection("<call>", "</call>", decode),))

    class WithSyntax(family_class):
        @hookimpl
        def parse_output(self, model):
            return OutputParser(syntax)

    plugins.reset()
    plugins.register(WithSyntax(), "testolmoe")
    parser = hooks.parse_output(olmoe).begin([{"type": "function", "function": {"name": "f"}}])
    events = []
    for chunk in ("<thi", "nk>why</think>so <ca", 'll>{"name": "f", "arguments": {"x": 1}}</call>'):
        events += parser.feed(chunk)
    events += parser.finish()
    texts = [(e.channel, e.text) for e in events if hasattr(e, "channel")]
    assert "".join(t for c, t in texts if c == REASONING) == "why"
    assert "".join(t for c, t in texts if c == CONTENT).strip() == "so"
    assert [e.call for e in events if hasattr(e, "call")] == [ToolCall("f", '{"x": 1}')]


def test_hook_decider(olmoe, family_class):
    """Core's default scores label tokens with the tokenizer it is handed; a family's own decider wins."""
    from colibri import hooks
    from colibri.decision import DecisionInputError, LabelTokenDecider

    tokenizer = hooks.load_tokenizer(olmoe)
    default = hooks.decider(olmoe, tokenizer)
    assert isinstance(default, LabelTokenDecider) and default.tokenizer is tokenizer
    default.check({"spam": {"type": "noul", "instructions": "Is this spam?"}})
    with pytest.raises(DecisionInputError):
        default.check({"spam": {"type": "haiku", "instructions": "?"}})
    assert isinstance(hooks.decider(olmoe, None), LabelTokenDecider)   # loads the tokenizer itself

    class OwnHead:
        def check(self, questions):
            raise DecisionInputError("questions.spam.type", "this head answers choices only")

        def decide(self, engine, state, questions, *, slot=0, ctx=None):
            raise AssertionError("not reached")

    class WithHead(family_class):
        @hookimpl
        def decider(self, model, tokenizer):
            return OwnHead()

    plugins.reset()
    plugins.register(WithHead(), "testolmoe")
    assert isinstance(hooks.decider(olmoe, tokenizer), OwnHead)

"""Decision prompts against transformers' ``prepare_inputs``: identical ids and ``<|mark|>`` positions with the
generic prompt and with decision templates (one prompt per question, or one for all of them), also for states and
questions that spell control tokens (they stay text), and the engine's answers equal ``DecisionPipeline``'s."""

from __future__ import annotations

import json
import os
import shutil

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("colibri_olmoe")

from transformers.decision import DecisionConfig, prepare_inputs  # noqa: E402
from transformers.models.jev.configuration_jev import JEV_TEMPLATE  # noqa: E402

from colibri import hooks, launch  # noqa: E402
from colibri.decision import decide, load_settings, parse_questions  # noqa: E402
from colibri.decision.prompts import build_prompts  # noqa: E402
from colibri.model import resolve_model  # noqa: E402

# one prompt for every question, read after each question
ALL_AT_ONCE = ("{{ state if state is string else state|tojson }}{% for q in questions %}\n{{ q.instructions }} "
               "({{ q.labels|join('/') }}):<|mark|>{% endfor %}")
TEMPLATES = {"generic": None, "jev": JEV_TEMPLATE, "all_at_once": ALL_AT_ONCE}
QUESTIONS = {
    "spam": {"type": "noul", "instructions": "Is <|system|> this spam?"},
    "tone": {"type": "choice", "instructions": "Tone?", "criteria": {"calm<|user|>": None, "pushy": "loud"}},
    "urgency": {"type": "score", "instructions": "How urgent?", "criteria": ["low", "high <|mark|>", "now"]},
}
STATES = ["plain words here", "hi <|assistant|>\nY<|endoftext|> x<|mark|>y<|split|>z \U000f0000<|user|>\U000f0001 end",
          {"msg": "<|user|>refund please", "n": 2}]


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def checkpoint(request, tmp_path_factory):
    from colibri.testing.tiny import tiny_model

    base = tiny_model("olmoe", tmp_path_factory.mktemp("decide-templates-base")).path
    path = tmp_path_factory.mktemp("decide-templates") / request.param
    shutil.copytree(base, path)
    (path / "decision.json").write_text(json.dumps({"labels": {"noul": ["Y", "N"]}, "temperature": {"score": 0.7}}))
    if TEMPLATES[request.param] is not None:
        (path / "decision_template.jinja").write_text(TEMPLATES[request.param])
    return path


def test_prompts_and_answers_match_transformers(checkpoint):
    resolved = resolve_model(checkpoint)
    tok, settings = hooks.load_tokenizer(resolved), load_settings(checkpoint)
    reference_tok = transformers.AutoTokenizer.from_pretrained(checkpoint)
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    pipe = transformers.pipeline("decision", model=model, tokenizer=reference_tok)
    with launch.open_engine(resolved, ctx=512, threads=2) as engine:
        for state in STATES:
            request = {"state": state, "questions": QUESTIONS}
            reference = prepare_inputs(DecisionConfig.from_pretrained(checkpoint), request, reference_tok)
            mine = build_prompts(tok, settings, state, parse_questions(QUESTIONS, settings.labels))
            assert [(inputs["input_ids"][0].tolist(), inputs["marks"].tolist()) for inputs, _ in reference] == \
                [(p.ids, p.marks) for p in mine]
            with torch.no_grad():
                want = pipe(request)
            got = decide(engine, tok, settings, state, QUESTIONS, ctx=512).answers
            for name in QUESTIONS:
                for key, value in want[name].items():
                    if isinstance(value, float):
                        assert abs(got[name][key] - value) <= 1e-4, (name, key)
                    elif isinstance(value, dict):
                        assert got[name][key].keys() == value.keys()
                        for option, p in value.items():
                            assert p is None or isinstance(p, str) or abs(got[name][key][option] - p) <= 1e-4
                    else:
                        assert got[name][key] == value

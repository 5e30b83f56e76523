"""System One decisions on any language model: closed questions about a state, answered with probabilities from
one prefill and no generation (what transformers' ``DecisionPipeline`` does for a plain causal LM).

- :mod:`.questions`: the three question types (``noul``, ``choice``, ``score``), their validation and answers;
- :mod:`.state`: the state (text, object or text parts), checked and optionally joined;
- :mod:`.settings`: a checkpoint's ``decision.json`` / ``decision_template.jinja`` (labels, temperatures, prompt);
- :mod:`.prompts`: a request rendered and tokenized into prompts, the positions to read and the label tokens;
- :mod:`.scoring`: the prompts run through an engine's ``decide`` op and turned into answers;
- :mod:`.decider`: the shape the ``decider`` hook answers with, and core's default (label tokens' logits).

Design notes: docs/architecture.md ("Decisions").
"""

from .questions import MAX_QUESTIONS, DecisionInputError, Question, parse_questions
from .decider import Decider, LabelTokenDecider
from .scoring import Decision, decide
from .settings import DecisionSettings, load_settings
from .state import check_state

__all__ = ["MAX_QUESTIONS", "Decider", "Decision", "DecisionInputError", "DecisionSettings", "LabelTokenDecider",
           "Question", "check_state", "decide", "load_settings", "parse_questions"]

"""Who answers a model's System One questions: the ``decider`` hook's answer.

Core's default scores a language model by its label tokens' logits (:class:`LabelTokenDecider`, what
transformers' ``DecisionPipeline`` does for a causal LM). A family whose models decide otherwise (a decision head
over a backbone, an encoder with its own classification heads) answers the ``decider`` hook with its own object
of the :class:`Decider` shape; the server's ``/v1/systemone`` and ``coli decide`` only ever talk to that shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from ..tokenizer import TextTokenizer
from .questions import parse_questions
from .scoring import Decision, decide
from .settings import DecisionSettings


class Decider(Protocol):
    """How one served model answers typed questions about a state.

    A decider whose model cuts any state to fit its sequence (a Laya model keeps the start of a text, the end of a
    conversation) sets a ``cuts_state = True`` attribute: the server then does not refuse a long state by its size.
    """

    def check(self, questions: Any) -> None:
        """Refuse questions this model cannot answer before anything queues.

        :param questions: the request's ``questions`` object (id -> ``{type, instructions, criteria}``).
        :raises colibri.decision.DecisionInputError: naming the question and field.
        """

    def decide(self, engine: Any, state: Any, questions: Any, *, slot: int = 0, ctx: int | None = None) -> Decision:
        """Answer ``questions`` about ``state`` with the running ``engine`` (blocking; called off the event loop).

        :param engine: the running engine (``colibri.engine.Engine``); its ``ready`` announces ``"decide"``.
        :param state: the checked state (text, object or text parts).
        :param questions: the request's questions, already passed through :meth:`check`.
        :param slot: the KV slot this request holds (a pinned state is reused there).
        :param ctx: the engine's context length, to refuse prompts that cannot fit.
        :returns: the answers by question id, in the request's order, and the token counts.
        """


@dataclass
class LabelTokenDecider:
    """Core's default: the decision prompts of the model's template, scored by their label tokens' logits."""

    tokenizer: TextTokenizer
    settings: DecisionSettings

    def check(self, questions: Any) -> None:
        parse_questions(questions, self.settings.labels, self.settings.noul_options)

    def decide(self, engine: Any, state: Any, questions: Any, *, slot: int = 0, ctx: int | None = None) -> Decision:
        return decide(engine, self.tokenizer, self.settings, state, questions, slot=slot, ctx=ctx)

"""``--think/--no-think`` sets whichever switch the checkpoint's template reads: Qwen3/GLM's ``enable_thinking``
or DeepSeek V3.1+'s ``thinking``; a template without one refuses the flag."""

from __future__ import annotations

import pytest

from colibri.errors import UsageError
from colibri.prompt import thinking_kwargs, thinking_switch

QWEN = "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>{% endif %}"
DEEPSEEK = "{% if add_generation_prompt %}<|Assistant|>{% if thinking %}<think>{% else %}</think>{% endif %}{% endif %}"
DEEPSEEK_DEFINED = "{%- if thinking is defined and thinking -%}<think>{%- endif -%}"
PROSE = "{{ 'Take your time thinking about the answer.' }}{{ messages[0]['content'] }}"


@pytest.mark.parametrize("source, switch", [(QWEN, "enable_thinking"), (DEEPSEEK, "thinking"),
                                            (DEEPSEEK_DEFINED, "thinking"), (PROSE, None), ("", None)])
def test_the_switch_is_read_from_how_the_template_tests_it(source, switch):
    assert thinking_switch(source) == switch


class FakeTemplate:
    def __init__(self, source):
        self.source = source


class FakeTokenizer:
    def __init__(self, source):
        self.templates = {"default": FakeTemplate(source)}


def test_the_flag_goes_to_the_switch_the_template_has():
    assert thinking_kwargs(FakeTokenizer(DEEPSEEK), True) == {"thinking": True}
    assert thinking_kwargs(FakeTokenizer(QWEN), False) == {"enable_thinking": False}
    assert thinking_kwargs(FakeTokenizer(PROSE), None) == {}
    with pytest.raises(UsageError, match="--no-think"):
        thinking_kwargs(FakeTokenizer(PROSE), False)

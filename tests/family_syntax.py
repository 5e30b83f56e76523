"""Each tool-calling family's prompt and output format, for the parser, prompt and server tests.

The templates are written for these tests in the style of each family's released chat template: the same tool
declaration, assistant ``tool_calls``, tool-result and thinking-switch constructs, in fewer lines. The sample
outputs are written by hand in each family's tool-call syntax as its template and model card spell it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"}, "units": {"type": "string"}},
            "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "search", "description": "Search the web",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"},
                                                        "filters": {"type": "object"}}}}},
]

GLM_TEMPLATE = """[gMASK]<sop>
{%- if tools -%}
<|system|>
# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{% for tool in tools %}
{{ tool | tojson(ensure_ascii=False) }}
{% endfor %}
</tools>

For each function call, output the function name and arguments within the following XML format:
<tool_call>{function-name}
<arg_key>{arg-key-1}</arg_key>
<arg_value>{arg-value-1}</arg_value>
...
</tool_call>
{%- endif -%}
{%- for m in messages -%}
{%- if m.role == 'system' -%}
<|system|>
{{ m.content }}
{%- elif m.role == 'user' -%}
<|user|>
{{ m.content }}{{ '/nothink' if enable_thinking is defined and not enable_thinking else '' }}
{%- elif m.role == 'assistant' -%}
<|assistant|>
{%- if m.reasoning_content is defined %}
<think>{{ m.reasoning_content.strip() }}</think>
{%- else %}
<think></think>
{%- endif -%}
{%- if m.content %}

{{ m.content.strip() }}
{%- endif -%}
{%- for tc in m.tool_calls | default([]) -%}
{%- set tc = tc.function %}
<tool_call>{{ tc.name }}
{% for k, v in tc.arguments.items() -%}
<arg_key>{{ k }}</arg_key>
<arg_value>{{ v | tojson(ensure_ascii=False) if v is not string else v }}</arg_value>
{% endfor -%}
</tool_call>
{%- endfor -%}
{%- elif m.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}<|observation|>{%- endif %}
<tool_response>
{{ m.content }}
</tool_response>
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|assistant|>{{ '\\n<think></think>' if enable_thinking is defined and not enable_thinking else '' }}
{%- endif -%}"""

QWEN_TEMPLATE = """{%- if tools %}
{{- '<|im_start|>system\\n# Tools\\n\\nYou have access to the following functions:\\n\\n<tools>' }}
{%- for tool in tools %}
{{- '\\n' }}{{- tool | tojson }}
{%- endfor %}
{{- '\\n</tools>\\n\\nIf you choose to call a function ONLY reply in the following format with NO suffix:\\n\\n' }}
{{- '<tool_call>\\n<function=example_function_name>\\n<parameter=example_parameter_1>\\nvalue_1\\n</parameter>\\n' }}
{{- '</function>\\n</tool_call>' }}
{%- if messages[0].role == 'system' %}{{- '\\n\\n' + messages[0].content }}{%- endif %}
{{- '<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for m in messages %}
{%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}
{%- elif m.role == 'assistant' %}
{%- set content = m.content if m.content is string else '' %}
{{- '<|im_start|>assistant\\n' }}
{%- if m.reasoning_content is string %}
{{- '<think>\\n' + m.reasoning_content.strip('\\n') + '\\n</think>\\n\\n' }}
{%- endif %}
{{- content | trim }}
{%- for tc in m.tool_calls | default([]) %}
{%- set tc = tc.function %}
{%- if loop.first %}{{- '\\n\\n' if content | trim else '' }}{%- else %}{{- '\\n' }}{%- endif %}
{{- '<tool_call>\\n<function=' + tc.name + '>\\n' }}
{%- for name, value in tc.arguments | items %}
{{- '<parameter=' + name + '>\\n' }}
{{- (value | tojson if value is not string else value) + '\\n</parameter>\\n' }}
{%- endfor %}
{{- '</function>\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif m.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}
{%- else %}{{- '<think>\\n' }}{%- endif %}
{%- endif %}"""

DEEPSEEK_TEMPLATE = """{{ bos_token }}
{%- set ns = namespace(system='') -%}
{%- for m in messages if m.role == 'system' -%}{%- set ns.system = ns.system + m.content -%}{%- endfor -%}
{{ ns.system }}
{%- if tools %}

## Tools
You have access to the following tools:
{% for tool in tools %}
### {{ tool.function.name }}
Description: {{ tool.function.description }}

Parameters: {{ tool.function.parameters | tojson }}
{% endfor %}
IMPORTANT: ALWAYS adhere to this exact format for tool use:
<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>tool_call_name<｜tool▁sep｜>tool_call_arguments<｜tool▁call▁end｜><｜tool▁calls▁end｜>
{% endif -%}
{%- for m in messages -%}
{%- if m.role == 'user' -%}
<｜User｜>{{ m.content }}
{%- elif m.role == 'assistant' -%}
<｜Assistant｜></think>{{ m.content if m.content else '' }}
{%- if m.tool_calls -%}
<｜tool▁calls▁begin｜>
{%- for tc in m.tool_calls -%}
<｜tool▁call▁begin｜>{{ tc.function.name }}<｜tool▁sep｜>{{ tc.function.arguments | tojson }}<｜tool▁call▁end｜>
{%- endfor -%}
<｜tool▁calls▁end｜>
{%- endif -%}
<｜end▁of▁sentence｜>
{%- elif m.role == 'tool' -%}
<｜tool▁output▁begin｜>{{ m.content }}<｜tool▁output▁end｜>
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<｜Assistant｜>{{ '<think>' if thinking is defined and thinking else '</think>' }}
{%- endif -%}"""

KIMI_TEMPLATE = """{%- if tools -%}
<|im_system|>tool_declare<|im_middle|>{{ tools | tojson(separators=(',', ':')) }}<|im_end|>
{%- endif -%}
{%- for m in messages -%}
{%- if m.role == 'system' -%}
<|im_system|>system<|im_middle|>{{ m.content }}<|im_end|>
{%- elif m.role == 'user' -%}
<|im_user|>user<|im_middle|>{{ m.content }}<|im_end|>
{%- elif m.role == 'assistant' -%}
<|im_assistant|>assistant<|im_middle|>
{%- if m.reasoning_content is defined %}<think>{{ m.reasoning_content }}</think>{% endif -%}
{{ m.content if m.content else '' }}
{%- if m.tool_calls -%}
<|tool_calls_section_begin|>
{%- for tc in m.tool_calls -%}
<|tool_call_begin|>{{ tc.id }}<|tool_call_argument_begin|>
{%- if tc.function.arguments is string %}{{ tc.function.arguments }}
{%- else %}{{ tc.function.arguments | tojson }}{% endif -%}
<|tool_call_end|>
{%- endfor -%}
<|tool_calls_section_end|>
{%- endif -%}
<|im_end|>
{%- elif m.role == 'tool' -%}
<|im_system|>tool<|im_middle|>## Return of {{ m.tool_call_id }}
{{ m.content }}<|im_end|>
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_assistant|>assistant<|im_middle|>
{%- endif -%}"""


@dataclass(frozen=True)
class Sample:
    """One reply in a family's syntax and what a parser must make of it."""

    text: str
    reasoning: str
    content: str
    calls: tuple[tuple[str, dict, str], ...]    # (name, arguments, id or "")
    in_reasoning: bool = False                   # the prompt left <think> open


@dataclass(frozen=True)
class Family:
    name: str           # the family plugin's name
    package: str
    tiny_kind: str      # colibri.testing.tiny kind whose tokenizer (and chat style) this family's tests train
    template: str
    thinking_switch: str
    samples: tuple[Sample, ...]


WEATHER = ("get_weather", {"city": "Köln", "days": 3}, "")
SEARCH = ("search", {"query": "a < b & c", "filters": {"site": "x.org", "n": [1, 2]}}, "")

FAMILIES = {
    "glm": Family("glm", "colibri_glm", "glm4_moe_lite", GLM_TEMPLATE, "enable_thinking", (
        Sample("<think>The user wants weather.</think>\nLet me check.\n<tool_call>get_weather\n<arg_key>city"
               "</arg_key>\n<arg_value>Köln</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n"
               "</tool_call>", "The user wants weather.", "Let me check.", (WEATHER,)),
        # GLM-4.7 / 5 write no newlines inside a call; two calls in a row
        Sample("<think></think><tool_call>get_weather<arg_key>city</arg_key><arg_value>Köln</arg_value>"
               "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call><tool_call>search<arg_key>query"
               "</arg_key><arg_value>a < b & c</arg_value><arg_key>filters</arg_key><arg_value>"
               + json.dumps(SEARCH[1]["filters"]) + "</arg_value></tool_call>", "", "", (WEATHER, SEARCH)),
        Sample("<think>hmm <b></think>It is 3 < 4, </tool not a marker.", "hmm <b>",
               "It is 3 < 4, </tool not a marker.", ()),
    )),
    "qwen": Family("qwen", "colibri_qwen", "qwen3_next", QWEN_TEMPLATE, "enable_thinking", (
        # Qwen3.5 / Qwen3-Coder form; the prompt opened <think>
        Sample("Weather first.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nKöln\n"
               "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>", "Weather first.\n",
               "", (WEATHER,), in_reasoning=True),
        # Qwen3's Hermes JSON form, with text before and two calls
        Sample("<think>\nok\n</think>\n\nSure.\n\n<tool_call>\n" + json.dumps(
            {"name": "get_weather", "arguments": WEATHER[1]}, ensure_ascii=False) + "\n</tool_call>\n<tool_call>\n"
               + json.dumps({"name": "search", "arguments": SEARCH[1]}) + "\n</tool_call>",
               "ok\n", "Sure.", (WEATHER, SEARCH)),
        Sample("Plain answer with <tool_call>{broken</tool_call> inside.", "",
               "Plain answer with <tool_call>{broken</tool_call> inside.", ()),
    )),
    "deepseek-v4": Family("deepseek-v4", "colibri_deepseek_v4", "deepseek_v3", DEEPSEEK_TEMPLATE,
                          "thinking", (
        # V3.1 thinking mode: the prompt ends with <think>
        Sample("Need weather.</think>Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
               + json.dumps(WEATHER[1], ensure_ascii=False) + "<｜tool▁call▁end｜><｜tool▁call▁begin｜>search"
               "<｜tool▁sep｜>" + json.dumps(SEARCH[1]) + "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
               "Need weather.", "Checking.", (WEATHER, SEARCH), in_reasoning=True),
        # V3's form: "function", then the name and a json code fence
        Sample("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
               + json.dumps(WEATHER[1], ensure_ascii=False) + "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
               "", "", (WEATHER,)),
        Sample("No tools needed: 2 < 3.", "", "No tools needed: 2 < 3.", ()),
        # V3.2's DSML (string="false" values are JSON), after reasoning opened in the prompt
        Sample("Two calls.</think>\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
               "<｜DSML｜parameter name=\"city\" string=\"true\">Köln</｜DSML｜parameter>\n"
               "<｜DSML｜parameter name=\"days\" string=\"false\">3</｜DSML｜parameter>\n</｜DSML｜invoke>\n"
               "<｜DSML｜invoke name=\"search\">\n<｜DSML｜parameter name=\"query\" string=\"true\">a < b & c"
               "</｜DSML｜parameter>\n<｜DSML｜parameter name=\"filters\" string=\"false\">"
               + json.dumps(SEARCH[1]["filters"]) + "</｜DSML｜parameter>\n</｜DSML｜invoke>\n"
               "</｜DSML｜function_calls>", "Two calls.", "", (WEATHER, SEARCH), in_reasoning=True),
        # V4's DSML envelope
        Sample("<｜DSML｜tool_calls><｜DSML｜invoke name=\"get_weather\"><｜DSML｜parameter name=\"city\" "
               "string=\"true\">Köln</｜DSML｜parameter><｜DSML｜parameter name=\"days\" string=\"false\">3"
               "</｜DSML｜parameter></｜DSML｜invoke></｜DSML｜tool_calls>", "", "", (WEATHER,)),
        Sample("<｜DSML｜tool_calls><｜DSML｜invoke name=\"search\"><｜DSML｜parameter name=\"filters\" "
               "string=\"false\">{oops</｜DSML｜parameter></｜DSML｜invoke></｜DSML｜tool_calls>", "",
               "<｜DSML｜tool_calls><｜DSML｜invoke name=\"search\"><｜DSML｜parameter name=\"filters\" "
               "string=\"false\">{oops</｜DSML｜parameter></｜DSML｜invoke></｜DSML｜tool_calls>", ()),
    )),
    "kimi": Family("kimi", "colibri_kimi", "kimi_k2", KIMI_TEMPLATE, "", (
        Sample("<think>check it</think>I'll look.<|tool_calls_section_begin|><|tool_call_begin|>functions."
               "get_weather:0<|tool_call_argument_begin|>" + json.dumps(WEATHER[1], ensure_ascii=False)
               + "<|tool_call_end|><|tool_call_begin|>functions.search:1<|tool_call_argument_begin|>"
               + json.dumps(SEARCH[1]) + "<|tool_call_end|><|tool_calls_section_end|>", "check it", "I'll look.",
               ((*WEATHER[:2], "functions.get_weather:0"), (*SEARCH[:2], "functions.search:1"))),
        Sample("Just text <|tool_calls_section_begin|> never closed", "",
               "Just text <|tool_calls_section_begin|> never closed", ()),
    )),
}

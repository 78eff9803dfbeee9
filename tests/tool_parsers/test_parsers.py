"""Each family's parser on the texts models write, auto-detection and the prompt side."""
from __future__ import annotations

import json

import pytest

from llmserve.server.protocol.tool_calls import check_tools, tool_call_spec
from llmserve.tokenizer.chat_prompt import prepare_messages, tools_preamble
from llmserve.tool_parsers import PARSERS, TOOL_CALL_PARSERS, detect_parser, get_parser, resolve_parser
from tests.tool_parsers.helpers import stream, tool

WEATHER = tool("get_weather", {"city": {"type": "string"}, "days": {"type": "integer"},
                               "metric": {"type": "boolean"}, "where": {"type": "object"}})
TIME = tool("get_time")
TOOLS = [WEATHER, TIME]


def calls_of(family: str, text: str) -> tuple[object, list[tuple[str, object]]]:
    content, calls = PARSERS[family].parse(text, TOOLS)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def test_hermes_reads_blocks_arrays_names_after_arguments_and_string_arguments():
    text = ('Checking.\n<tool_call>\n{"arguments": {"city": "Oslo"}, "name": "get_weather"}\n'
            '</tool_call>\n<tool_call>[{"name": "get_time", "arguments": "{\\"tz\\": 1}"}]'
            '</tool_call>')
    assert calls_of("hermes", text) == ("Checking.", [("get_weather", {"city": "Oslo"}),
                                                      ("get_time", {"tz": 1})])
    # a close tag inside a JSON string is text of the arguments
    assert calls_of("hermes", '<tool_call>{"name": "get_time", "arguments": '
                              '{"s": "</tool_call>"}}</tool_call>')[1] == [
        ("get_time", {"s": "</tool_call>"})]


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',   # unknown function
    '<tool_call>not json</tool_call> after',
    'I would write <tool_call> here',                             # never closed, no JSON
])
def test_text_that_is_not_a_call_stays_content(text):
    assert PARSERS["hermes"].parse(text, TOOLS) == (text, [])
    assert stream(PARSERS["hermes"], TOOLS, list(text))[:2] == (text, [])


def test_llama3_json_reads_bare_objects_the_python_tag_and_semicolons():
    assert calls_of("llama3_json", ' {"name": "get_time", "parameters": {}}; '
                                   '{"name": "get_weather", "arguments": {"city": "A"}}') == (
        None, [("get_time", {}), ("get_weather", {"city": "A"})])
    assert calls_of("llama3_json", 'Sure.<|python_tag|>{"name": "get_time", "parameters": '
                                   '{"x": [1]}}') == ("Sure.", [("get_time", {"x": [1]})])
    # a JSON answer that is not a call, and JSON that does not open the answer, are content
    assert calls_of("llama3_json", '{"answer": 42}') == ('{"answer": 42}', [])
    text = 'Here: {"name": "get_time", "parameters": {}}'
    assert calls_of("llama3_json", text) == (text, [])


def test_mistral_reads_the_array_and_the_name_args_form():
    assert calls_of("mistral", '[TOOL_CALLS][{"name": "get_time", "arguments": {}}, '
                               '{"name": "get_weather", "arguments": {"city": "B"}}]') == (
        None, [("get_time", {}), ("get_weather", {"city": "B"})])
    assert calls_of("mistral", 'ok [TOOL_CALLS]get_weather[ARGS]{"city": "}"}'
                               '[TOOL_CALLS]get_time[ARGS]{}') == (
        "ok", [("get_weather", {"city": "}"}), ("get_time", {})])
    assert calls_of("mistral", "[TOOL_CALLS]nope[ARGS]{}") == ("[TOOL_CALLS]nope[ARGS]{}", [])


def test_qwen3_coder_converts_values_by_their_schema_type():
    text = ("Let me look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
            "New \"York\"\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
            "<parameter=metric>\nTrue\n</parameter>\n<parameter=where>\n{\"lat\": 1.5}\n"
            "</parameter>\n<parameter=note>\n07\n</parameter>\n</function>\n</tool_call>")
    assert calls_of("qwen3_coder", text) == ("Let me look.", [("get_weather", {
        "city": 'New "York"', "days": 3, "metric": True, "where": {"lat": 1.5},
        "note": "07"})])   # a parameter the schema does not name stays text
    # the forced (Hermes JSON) form is read too
    assert calls_of("qwen3_coder", '<tool_call>\n{"name": "get_time", "arguments": {}}\n'
                                   "</tool_call>")[1] == [("get_time", {})]


def test_qwen3_coder_streams_a_text_value_as_it_arrives():
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n"
            "</parameter>\n</function>\n</tool_call>")
    _, calls, deltas = stream(PARSERS["qwen3_coder"], TOOLS, list(text))
    assert calls[0].arguments == '{"city": "San Francisco"}'
    assert len(deltas[0]) > 10        # a delta per character of the value


def test_pythonic_reads_literals_and_refuses_expressions():
    assert calls_of("pythonic", "[get_weather(city='Oslo', days=2, where={'a': (1, None)}),"
                                " get_time()]") == (None, [
        ("get_weather", {"city": "Oslo", "days": 2, "where": {"a": [1, None]}}),
        ("get_time", {})])
    assert calls_of("pythonic", "[1, 2, 3]") == ("[1, 2, 3]", [])
    # an expression is not a literal: the call was sent, its arguments stop there
    content, calls = PARSERS["pythonic"].parse("[get_time(x=os.getcwd())]", TOOLS)
    assert [c.name for c in calls] == ["get_time"] and "getcwd" not in calls[0].arguments


def test_held_back_markers_and_whitespace_between_calls():
    parser = PARSERS["hermes"]
    s = parser.streamer(TOOLS)
    assert s.feed("Hi <tool") == ("Hi ", [])           # may become a marker: held
    assert s.feed("_ca")[0] == ""
    assert s.feed("x") == ("<tool_cax", [])            # it did not
    s = parser.streamer(TOOLS)
    s.feed('<tool_call>{"name": "get_time"}</tool_call>')
    assert s.feed("\n\n") == ("", [])                  # after a call: held
    assert s.feed("Done") == ("\n\nDone", [])


@pytest.mark.parametrize("template,expected", [
    (None, "hermes"), ("{{ messages }}", "hermes"),
    ("{% if tools %}<tool_call>{{ tool }}</tool_call>{% endif %}", "hermes"),
    ("{{- '<|python_tag|>' + tool_call.name }}", "llama3_json"),
    ("{{ '[TOOL_CALLS]' }}{{ tools }}", "mistral"),
    ("<tool_call>\n<function={{ tool_call.name }}>", "qwen3_coder"),
    ("[func_name1(params_name1=params_value1)]", "pythonic"),
])
def test_auto_detection_from_the_chat_template(template, expected):
    assert detect_parser(template)[0].name == expected
    assert resolve_parser("auto", template).name == expected


def test_flag_names_and_unknown_names():
    assert set(TOOL_CALL_PARSERS) == {"auto", "hermes", "llama3_json", "mistral",
                                      "qwen3_coder", "pythonic"}
    assert resolve_parser("mistral", "<tool_call>").name == "mistral"
    with pytest.raises(ValueError, match="tool_call_parser"):
        get_parser("gorilla")


def test_every_parser_has_a_valid_forcing_grammar_in_its_format():
    pytest.importorskip("llguidance")
    tools = check_tools(TOOLS)
    for parser in PARSERS.values():
        spec = tool_call_spec(tools, {"name": "get_weather"}, False, parser)
        assert spec is not None and "%json" in spec.value
    assert '"[TOOL_CALLS]["' in tool_call_spec(tools, "required", True, PARSERS["mistral"]).value
    assert '"parameters"' in tool_call_spec(tools, "required", True,
                                            PARSERS["llama3_json"]).value


def test_the_prompt_side_speaks_the_chosen_format():
    tools = check_tools([WEATHER])
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "c1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    # hermes (the default, SmolLM2's): unchanged
    messages, native = prepare_messages(history, tools, "{{ messages }}")
    assert native is None and messages[0]["content"] == tools_preamble(tools)
    assert messages[2]["content"] == ('<tool_call>\n{"name": "get_weather", "arguments": '
                                      '{"city": "Rome"}}\n</tool_call>')
    assert messages[3]["content"] == "<tool_response>\nsunny\n</tool_response>"
    for name, marker in (("mistral", "[TOOL_CALLS]"), ("llama3_json", '"parameters"'),
                         ("qwen3_coder", "<function=get_weather>"),
                         ("pythonic", "get_weather(city='Rome')")):
        messages, _ = prepare_messages(history, tools, "{{ messages }}", PARSERS[name])
        assert marker in messages[2]["content"], name
        assert "get_weather" in messages[0]["content"]
    # a template that renders tools and tool calls gets them as they are
    messages, native = prepare_messages(history, tools, "{{ tools }}{{ m.tool_calls }}",
                                        PARSERS["mistral"])
    assert native == tools and messages[1]["tool_calls"]


def test_a_request_takes_the_served_models_format_and_keeps_its_special_tokens():
    from llmserve.server.protocol.openai import ChatCompletionRequest, parse_request

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "tools": [WEATHER], "tool_choice": "required"}
    req = parse_request(ChatCompletionRequest, json.dumps(body).encode())
    assert "<tool_call>" in req.output_spec.value          # checked as Hermes first
    assert "skip_special_tokens" not in req.sampling_kwargs()
    req.use_tool_parser(PARSERS["mistral"])
    assert req.tool_parser.name == "mistral" and "[TOOL_CALLS]" in req.output_spec.value
    assert req.sampling_kwargs()["skip_special_tokens"] is False
    explicit = parse_request(ChatCompletionRequest, json.dumps(
        {**body, "skip_special_tokens": True}).encode())
    explicit.use_tool_parser(PARSERS["llama3_json"])
    assert explicit.sampling_kwargs()["skip_special_tokens"] is True
    none = parse_request(ChatCompletionRequest, json.dumps(
        {**body, "tool_choice": "none"}).encode())
    none.use_tool_parser(PARSERS["mistral"])
    assert none.output_spec is None and "skip_special_tokens" not in none.sampling_kwargs()

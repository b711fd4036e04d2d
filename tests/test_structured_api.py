"""Structured outputs through the interfaces: ``LLM``, ``speclm generate`` and the server's
OpenAI ``response_format`` (driven by the official ``openai`` client) plus the
``structured_outputs`` extension; bad schemas and grammars are one-line errors and 400s; one test
on the real default model."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from speclm import LLM, SamplingParams
from speclm.errors import SpeclmError

from .test_cli import cli
from .test_structured import GBNF, GRAMMAR_RE, REGEX, SCHEMA

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from speclm.serve.launch import ServeOptions, build_app  # noqa: E402


def validates(text: str, schema: dict = SCHEMA) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


@pytest.fixture(scope="module")
def llm(model_dirs):
    return LLM(str(model_dirs["target"]), "ngram", 4, dtype="float64", adaptive_draft=False)


def test_llm_json_schema_is_valid_and_greedy_identical_to_plain(llm):
    params = SamplingParams(max_tokens=80, json_schema=SCHEMA)
    spec = llm.generate("the quick brown fox", params)[0]
    plain = llm.generate("the quick brown fox", params, speculative=False)[0]
    assert validates(spec.text), spec.text
    assert spec.token_ids == plain.token_ids and spec.finish_reason == "stop"
    assert spec.stats.constrained and spec.stats.forced_tokens > 0
    assert "grammar: forced" in spec.stats.summary()
    chat = llm.chat([{"role": "user", "content": "hello"}], SamplingParams(max_tokens=40, regex=REGEX))
    assert re.fullmatch(REGEX, chat.text)


def test_llm_bad_schema_is_a_speclm_error(llm):
    with pytest.raises(SpeclmError, match="JSON schema is invalid"):
        llm.generate("hi", SamplingParams(json_schema={"type": "wat"}))
    with pytest.raises(SpeclmError, match="at most one"):
        llm.generate("hi", SamplingParams(regex="a", grammar="start: a"))


def test_cli_json_schema_and_grammar(capsys, model_dirs, tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    common = ["--model", str(model_dirs["target"]), "--dtype", "float64", "--raw", "-n", "80"]
    code, out, err = cli(capsys, "generate", "the quick brown fox", "--json-schema", str(schema),
                         "--compare", *common)
    assert code == 0 and validates(out.strip()), out
    assert "grammar: forced" in err and "outputs identical" in err
    grammar = tmp_path / "g.gbnf"
    grammar.write_text(GBNF)
    code, out, _ = cli(capsys, "generate", "def add", "--grammar", str(grammar), "--ngram", *common)
    assert code == 0 and re.fullmatch(GRAMMAR_RE[GBNF], out.strip())


@pytest.mark.parametrize("flags, fragment", [
    (["--json-schema", "SCHEMA_BAD"], "JSON schema is invalid"),
    (["--json-schema", "SCHEMA_NOT_JSON"], "not valid JSON"),
    (["--json-schema", "MISSING"], "cannot read JSON schema file"),
    (["--regex", "(unclosed"], "regex is invalid"),
    (["--grammar", "GRAMMAR_BAD"], "grammar is invalid"),
    (["--regex", "a", "--json-object"], "not allowed with"),
])
def test_cli_bad_constraints_exit_2_with_one_line(capsys, model_dirs, tmp_path, flags, fragment):
    files = {"SCHEMA_BAD": '{"type": "wat"}', "SCHEMA_NOT_JSON": "{type: object",
             "GRAMMAR_BAD": "start: undefined_rule"}
    argv = []
    for flag in flags:
        if flag in files:
            path = tmp_path / flag
            path.write_text(files[flag])
            flag = str(path)
        argv.append(str(tmp_path / "none") if flag == "MISSING" else flag)
    code, _, err = cli(capsys, "generate", "hi", "--model", str(model_dirs["target"]),
                       "--dtype", "float64", *argv)
    assert code == 2 and fragment in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.fixture(scope="module")
def client(model_dirs):
    opts = ServeOptions(model=str(model_dirs["target"]), dtype="float64", max_batch=4, max_queue=8,
                        served_model_name="tiny", shutdown_grace_s=2.0)
    with TestClient(build_app(opts), base_url="http://localhost") as test_client:
        yield test_client


@pytest.fixture(scope="module")
def oai(client):
    """The official client over the in-process app (TestClient is an httpx.Client)."""
    return openai.OpenAI(base_url="http://localhost/v1", api_key="none", http_client=client, max_retries=0)


def test_server_response_format_json_schema_on_chat_and_completions(oai, llm):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    chat = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}],
                                       max_tokens=80, temperature=0, response_format=fmt)
    text = chat.choices[0].message.content
    assert validates(text) and chat.choices[0].finish_reason == "stop"
    solo = llm.chat([{"role": "user", "content": "hello"}], SamplingParams(max_tokens=80, json_schema=SCHEMA),
                    speculative=False)
    assert text == solo.text  # greedy: the constrained plain output
    assert chat.model_extra["speclm"]["forced_tokens"] >= 0
    done = oai.completions.create(model="tiny", prompt="the quick brown fox", max_tokens=80,
                                  temperature=0.8, seed=3, extra_body={"response_format": fmt})
    assert validates(done.choices[0].text)


def test_server_json_object_and_extension_field(oai):
    chat = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=200, temperature=0, response_format={"type": "json_object"})
    text = chat.choices[0].message.content
    if chat.choices[0].finish_reason == "stop":  # a random model may not close the object in time
        assert isinstance(json.loads(text), dict)
    else:
        assert text.startswith("{")
    done = oai.completions.create(model="tiny", prompt="yes or no?", max_tokens=40, temperature=0,
                                  extra_body={"structured_outputs": {"regex": REGEX}})
    assert re.fullmatch(REGEX, done.choices[0].text)
    stream = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                         max_tokens=40, temperature=0, stream=True,
                                         extra_body={"structured_outputs": {"grammar": GBNF}})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert re.fullmatch(GRAMMAR_RE[GBNF], text)


@pytest.mark.parametrize("extra, param, fragment", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}},
     "response_format", "JSON schema is invalid"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema: required"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "'text', 'json_object' or 'json_schema'"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", "regex is invalid"),
    ({"structured_outputs": {"grammar": "root ::= [a-z"}}, "structured_outputs", "grammar is invalid"),
    ({"structured_outputs": {"regex": "a", "grammar": "start: a"}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
     "structured_outputs", "at most one"),
])
def test_server_bad_constraints_are_400(oai, extra, param, fragment):
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                    max_tokens=8, extra_body=extra)
    error = info.value.body
    assert info.value.status_code == 400 and fragment in error["message"], error
    assert error["param"] == param and "\n" not in error["message"]


def test_server_metrics_count_structured_requests(client, oai):
    oai.completions.create(model="tiny", prompt="yes?", max_tokens=40, temperature=0,
                           extra_body={"structured_outputs": {"regex": REGEX}})
    text = client.get("/metrics").text
    count = re.search(r"^speclm_structured_requests_total (\S+)$", text, re.M)
    assert count and float(count.group(1)) >= 1
    assert "speclm_structured_forced_tokens_total" in text
    assert "speclm_structured_grammar_rejected_tokens_total" in text


@pytest.mark.real_model
def test_default_model_writes_valid_json():
    llm = LLM("default", "ngram", 8, backend="torch", adaptive_draft=False)  # no cost model to time
    schema = {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 40}, "year": {"type": "integer"},
        "designer": {"type": "string", "maxLength": 60}}, "required": ["city", "year", "designer"],
        "additionalProperties": False}
    messages = [{"role": "user", "content": "The Marlow Bridge in Marlow was opened in 1832 and "
                 "designed by William Tierney Clark. Give the city, year and designer as JSON."}]
    params = SamplingParams(max_tokens=96, json_schema=schema)
    out = llm.chat(messages, params)
    assert validates(out.text, schema), out.text
    assert out.finish_reason == "stop" and out.stats.forced_tokens > 0
    assert out.token_ids == llm.chat(messages, params, speculative=False).token_ids
    obj = llm.chat(messages, SamplingParams(max_tokens=96, json_object=True))
    assert obj.finish_reason != "stop" or isinstance(json.loads(obj.text), dict)


@pytest.mark.real_model
def test_default_model_on_llamacpp_writes_valid_json():
    """The grammar lives in the engine, so every backend gets it; on llama.cpp greedy identity with
    plain decoding holds up to its kernels' near-ties (docs/benchmarks.md), so validity is checked."""
    from speclm.models.llamacpp import llama_cpp_available

    if not llama_cpp_available():
        pytest.skip("llama-cpp-python not installed")
    llm = LLM("default", "ngram", 8, backend="llamacpp", adaptive_draft=False)
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                               "reason": {"type": "string", "maxLength": 80}},
              "required": ["answer", "reason"], "additionalProperties": False}
    out = llm.chat([{"role": "user", "content": "Is the Thames a river? Answer as JSON."}],
                   SamplingParams(max_tokens=64, json_schema=schema))
    assert validates(out.text, schema), out.text
    assert out.stats.backend == "llamacpp" and out.stats.forced_tokens > 0

"""Chat templates render only in jinja2's sandbox (``engine.chat_template``): the known escapes
are refused with an ``UnsupportedRequest`` and nothing they reach for runs, the runaway ones are
cut short, and honest templates render exactly as llama-cpp-python's formatter renders them. The
hostile template also comes inside a real model file, loaded by the real llama.cpp."""

from __future__ import annotations

import threading
import time
import tomllib
from pathlib import Path

import jinja2
import pytest
from llama_cpp.llama_chat_format import Jinja2ChatFormatter
from packaging.requirements import Requirement
from packaging.version import Version

from desktop_worker.engine.chat_template import ChatTemplate, TemplateLimits
from desktop_worker.engine.llama_model import LlamaContext
from desktop_worker.errors import UnsupportedRequest
from desktop_worker.store.gguf_info import read_gguf_info
from shared_schema.fitting import LoadPlan
from tests.support.gguf_mutants import SMOLLM2, load_base, model_with_chat_template

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi ünï 😀"},
            {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "2+2?"}]
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]

# What a hostile uploader puts in tokenizer.chat_template. {marker} is a file each one tries to
# create (through os.popen, or a subclass of object that reaches the os module).
ESCAPES = {
    "subclasses": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "subclasses_loop": "{% for c in [].__class__.__base__.__subclasses__() %}{{ c }}{% endfor %}",
    "cycler_globals": "{{ cycler.__init__.__globals__.os.popen('touch {marker}').read() }}",
    "joiner_globals": "{{ joiner.__init__.__globals__['os'].popen('touch {marker}') }}",
    "namespace_globals": "{{ namespace.__init__.__globals__.os.system('touch {marker}') }}",
    "own_function_globals": "{{ raise_exception.__globals__ }}",
    "template_context": "{{ self._TemplateReference__context.cycler.__init__.__globals__ }}",
    "attr_filter": "{{ (cycler|attr('__init__')|attr('__globals__'))['os'].popen("
                   "'touch {marker}') }}",
    "str_format": "{{ '{0.__init__.__globals__[os].popen}'.format(cycler) }}",
    # fixed in jinja2 3.1.5: a stored reference to str.format escaped the sandbox's check
    "stored_format": "{% set f = '{0.__class__.__mro__[1].__subclasses__}'.format %}"
                     "{{ f(messages) }}",
    # fixed in jinja2 3.1.6: str.format reached through the attr filter
    "format_through_attr": "{{ ('{0.__class__.__mro__[1].__subclasses__}'|attr('format'))("
                           "messages) }}",
    "map_attribute": "{{ messages|map(attribute='__class__')|list }}",
    "mutate_messages": "{{ messages.append({'role': 'system', 'content': 'x'}) }}",
    "function_code": "{{ strftime_now.__code__ }}",
}


def render(source: str, **kwargs: object) -> str:
    return ChatTemplate(source, bos_token="<s>", eos_token="</s>").render(MESSAGES, **kwargs)


def test_the_sandbox_is_jinja2_3_1_6_or_later() -> None:
    assert Version(jinja2.__version__) >= Version("3.1.6")
    project = tomllib.loads((Path(__file__).parents[3] / "pyproject.toml").read_text())
    extras = project["project"]["optional-dependencies"]
    for extra in ("worker", "queen"):  # wherever a template renders: chat, the admin pages
        pins = [Requirement(line) for line in extras[extra] if line.startswith("jinja2")]
        assert pins, extra
        assert all(not pin.specifier.contains("3.1.5") for pin in pins), extra


@pytest.mark.parametrize("name", sorted(ESCAPES))
def test_a_sandbox_escape_is_refused_and_nothing_runs(name: str, tmp_path: Path) -> None:
    marker = tmp_path / "escaped"
    source = ESCAPES[name].replace("{marker}", str(marker))
    with pytest.raises(UnsupportedRequest, match="its sandbox forbids") as caught:
        render(source)
    assert "nothing was run" in str(caught.value)
    assert not marker.exists()


def test_lipsum_and_its_globals_are_gone(tmp_path: Path) -> None:
    marker = tmp_path / "escaped"
    with pytest.raises(UnsupportedRequest, match="'lipsum' is undefined"):
        render(f"{{{{ lipsum.__globals__['os'].popen('touch {marker}').read() }}}}")
    assert not marker.exists()


@pytest.mark.parametrize(("source", "match"), [
    ("{{ 'a' * 1000000000 }}", "'\\*' would build 1,000,000,000 items"),
    ("{{ [1, 2] * 999999999 }}", "would build 1,999,999,998 items"),
    ("{{ 9 ** 99999999999 }}", "'\\*\\*' would build a number"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
     "ranges hold too many items"),
    ("{% for i in range(10000000) %}{% endfor %}", "Range too big"),
    ("{% for i in range(90000) %}{{ 'x' * 100 }}{% endfor %}", "prompt passed 8,388,608"),
])
def test_a_runaway_template_is_cut_short(source: str, match: str) -> None:
    started = time.perf_counter()
    with pytest.raises(UnsupportedRequest, match=match):
        render(source)
    assert time.perf_counter() - started < 5


def test_limits_can_be_set() -> None:
    small = TemplateLimits(max_output_chars=100, max_range_items=10)
    template = ChatTemplate("{% for i in range(5) %}{{ i }}{% endfor %}", limits=small)
    assert template.render(MESSAGES) == "01234"
    with pytest.raises(UnsupportedRequest, match="ranges hold too many"):
        ChatTemplate("{% for i in range(11) %}{% endfor %}", limits=small).render(MESSAGES)


# --- honest templates ----------------------------------------------------------------------------

CHATML_WITH_TOOLS = (
    "{%- if tools %}<|im_start|>system\n{{ tools|tojson }}<|im_end|>\n{%- endif %}"
    "{%- for message in messages %}{%- if loop.index0 > 9 %}{% break %}{% endif %}"
    "<|im_start|>{{ message.role }}\n{% generation %}{{ message.content|trim }}"
    "{% endgeneration %}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")


@pytest.mark.parametrize("source", ["real", CHATML_WITH_TOOLS])
def test_honest_templates_render_as_llama_cpp_python_renders_them(source: str) -> None:
    if source == "real":
        source = read_gguf_info(SMOLLM2).chat_template or ""
        assert "im_start" in source
    for messages in (MESSAGES, MESSAGES[1:], MESSAGES[1:2]):
        ours = ChatTemplate(source, bos_token="<s>", eos_token="</s>").render(
            messages, tools=TOOLS)
        theirs = Jinja2ChatFormatter(template=source, bos_token="<s>", eos_token="</s>")(
            messages=messages, tools=TOOLS).prompt  # type: ignore[arg-type]
        assert ours == theirs
        assert "ünï 😀" in ours or messages[1:2] != MESSAGES[1:2]


def test_the_templates_own_refusal_and_errors_are_unsupported_requests() -> None:
    with pytest.raises(UnsupportedRequest, match="refused the messages: roles must alternate"):
        render("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(UnsupportedRequest, match="cannot be read"):
        render("{% for %}")
    with pytest.raises(UnsupportedRequest, match="failed on the messages"):
        render("{{ messages[0].content + 1 }}")
    assert render("{{ strftime_now('%Y') }}") == time.strftime("%Y")
    assert render("{{ bos_token }}{{ eos_token }}") == "<s></s>"


# --- inside a real model, through the real llama.cpp ---------------------------------------------


def _chat(path: Path) -> list[dict[str, object]]:
    plan = LoadPlan(n_ctx=512, n_gpu_layers=0, offloaded_layers=0, vram_needed_mb=0, reason="")
    context = LlamaContext("edited", path, plan, n_threads=2)
    try:
        request = {"messages": MESSAGES[1:2], "max_tokens": 3, "temperature": 0}
        return list(context.stream("chat", request, threading.Event()))
    finally:
        context.close()


def test_a_model_whose_template_escapes_is_refused_by_the_engine(tmp_path: Path) -> None:
    base = load_base()
    marker = tmp_path / "escaped"
    hostile = ESCAPES["cycler_globals"].replace("{marker}", str(marker))
    path = model_with_chat_template(tmp_path / "hostile.gguf", hostile, base)
    assert read_gguf_info(path).chat_template == hostile  # a valid file: the store takes it

    with pytest.raises(UnsupportedRequest, match="its sandbox forbids"):
        _chat(path)
    assert not marker.exists()

    honest = model_with_chat_template(tmp_path / "honest.gguf",
                                      "{% for m in messages %}<|im_start|>{{ m.role }}\n"
                                      "{{ m.content }}<|im_end|>\n{% endfor %}"
                                      "<|im_start|>assistant\n", base)
    chunks = _chat(honest)  # the same edit, with an honest template, generates
    assert any(choice.get("delta", {}).get("content")  # type: ignore[union-attr]
               for chunk in chunks for choice in chunk["choices"])  # type: ignore[union-attr]
